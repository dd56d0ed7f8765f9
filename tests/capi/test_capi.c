// SPDX-License-Identifier: Apache-2.0
/* The growable buffer's and the KV cache's C API (vmmalloc.h), from C, on the host backend:
 * NULL checks, statuses and the last error (the C++ messages), failed calls that change nothing,
 * the documented address arithmetic, and the backend's live objects back to zero (no leak). */
#include <stdio.h>
#include <string.h>

#include "vmmalloc/vmmalloc.h"

static int failures = 0;
#define CHECK(cond, ...)                              \
  do {                                                \
    if (!(cond)) {                                    \
      ++failures;                                     \
      printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      printf(__VA_ARGS__);                            \
      printf("\n");                                   \
    }                                                 \
  } while (0)

static int has(const char* text) { return strstr(vmm_last_error(), text) != NULL; }

#define MiB ((size_t)1 << 20)

static void buffer_cases(void) {
  vmm_buffer* b = (vmm_buffer*)0x1;
  CHECK(vmm_buffer_create(NULL, &b) == VMM_ERROR_INVALID_VALUE && has("must not be NULL"), "%s", vmm_last_error());
  vmm_buffer_options o;
  vmm_buffer_options_init(&o);
  CHECK(o.backend == VMM_BACKEND_CUDA && o.capacity_limit == 0, "options_init");
  o.backend = VMM_BACKEND_HOST;
  CHECK(vmm_buffer_create(&o, &b) == VMM_ERROR_INVALID_VALUE && b == NULL && has("capacity_limit must be > 0"),
        "%s", vmm_last_error());
  o.backend = (vmm_backend_kind)7;
  o.capacity_limit = 8 * MiB;
  CHECK(vmm_buffer_create(&o, &b) == VMM_ERROR_INVALID_VALUE && has("unknown backend"), "%s", vmm_last_error());
  o.backend = VMM_BACKEND_HOST;
  o.peer_count = 1;
  CHECK(vmm_buffer_create(&o, &b) == VMM_ERROR_INVALID_VALUE && has("peers is NULL"), "%s", vmm_last_error());
  o.peer_count = 0;

  CHECK(vmm_buffer_create(&o, &b) == VMM_SUCCESS && b && vmm_last_error()[0] == 0, "create: %s", vmm_last_error());
  void* p = vmm_buffer_data(b);
  CHECK(p != NULL && vmm_buffer_size(b) == 0 && vmm_buffer_capacity(b) == 0, "empty buffer");
  CHECK(vmm_buffer_resize(b, 3 * MiB) == VMM_SUCCESS && vmm_buffer_size(b) == 3 * MiB, "resize 3 MiB");
  memset(p, 0x5a, 3 * MiB);
  CHECK(vmm_buffer_resize(b, 7 * MiB) == VMM_SUCCESS && vmm_buffer_data(b) == p, "grows in place");
  CHECK(((unsigned char*)p)[3 * MiB - 1] == 0x5a, "contents survive growth");
  vmm_buffer_info i;
  CHECK(vmm_buffer_get_info(b, &i) == VMM_SUCCESS && i.size == 7 * MiB && i.capacity >= 7 * MiB &&
            i.chunks == 2 && i.live_handles == 2 && i.live_mappings == 2 && i.live_reservations == 1,
        "info: size %zu capacity %zu chunks %zu live %zu/%zu", i.size, i.capacity, i.chunks, i.live_handles,
        i.live_mappings);
  CHECK(vmm_buffer_resize(b, 9 * MiB) == VMM_ERROR_OUT_OF_MEMORY && has("exceeds the capacity limit"), "%s",
        vmm_last_error());
  CHECK(vmm_last_status() == VMM_ERROR_OUT_OF_MEMORY, "last status");
  vmm_buffer_info j;
  CHECK(vmm_buffer_get_info(b, &j) == VMM_SUCCESS && j.size == 7 * MiB && j.chunks == 2 &&
            j.live_handles == i.live_handles,
        "a refused growth changes nothing");
  CHECK(vmm_buffer_reserve(b, 8 * MiB) == VMM_SUCCESS && vmm_buffer_size(b) == 7 * MiB &&
            vmm_buffer_capacity(b) == 8 * MiB,
        "reserve maps without resizing");
  CHECK(vmm_buffer_resize(b, 0) == VMM_SUCCESS && vmm_buffer_shrink_to_fit(b) == VMM_SUCCESS, "shrink");
  CHECK(vmm_buffer_get_info(b, &j) == VMM_SUCCESS && j.capacity == 0 && j.live_handles == 0 && j.live_mappings == 0,
        "shrunk to 0: live %zu/%zu", j.live_handles, j.live_mappings);
  CHECK(vmm_buffer_resize(NULL, 1) == VMM_ERROR_INVALID_VALUE && has("vmm_buffer_resize: buffer is NULL"), "%s",
        vmm_last_error());
  CHECK(vmm_buffer_data(NULL) == NULL && vmm_last_status() == VMM_ERROR_INVALID_VALUE, "data(NULL)");
  CHECK(vmm_buffer_get_info(b, NULL) == VMM_ERROR_INVALID_VALUE, "get_info(NULL out)");
  vmm_buffer_destroy(b);
  vmm_buffer_destroy(NULL);

  /* Physical memory: a host limit of 4 MiB (one chunk of 4 MiB) refuses more, and the refusal is rolled back. */
  o.host_physical_limit = 4 * MiB;
  CHECK(vmm_buffer_create(&o, &b) == VMM_SUCCESS, "create limited: %s", vmm_last_error());
  CHECK(vmm_buffer_resize(b, 4 * MiB) == VMM_SUCCESS, "4 MiB fits");
  CHECK(vmm_buffer_resize(b, 6 * MiB) == VMM_ERROR_OUT_OF_MEMORY && vmm_buffer_size(b) == 4 * MiB, "%s",
        vmm_last_error());
  CHECK(vmm_buffer_get_info(b, &i) == VMM_SUCCESS && i.live_handles == 1 && i.chunks == 1 && i.failures >= 1,
        "nothing leaked by the refused growth (%zu handles)", i.live_handles);
  vmm_buffer_destroy(b);
}

static void kv_cases(void) {
  vmm_kv_config c;
  vmm_kv_config_init(&c);
  CHECK(c.elem_bytes == 2 && c.layers == 0 && c.retain_closed == 0, "config_init");
  vmm_kv_cache* kv = NULL;
  c.backend = VMM_BACKEND_HOST;
  CHECK(vmm_kv_create(&c, &kv) == VMM_ERROR_INVALID_VALUE && kv == NULL && has("config.layers must be > 0"), "%s",
        vmm_last_error());
  CHECK(vmm_kv_create(NULL, &kv) == VMM_ERROR_INVALID_VALUE, "NULL config");
  c.layers = 3;
  c.kv_heads = 2;
  c.head_dim = 64;  /* T = 256 bytes: 8192 tokens a 2 MiB page */
  c.max_seqs = 4;
  c.max_tokens = 10000;
  CHECK(vmm_kv_create(&c, &kv) == VMM_SUCCESS && kv, "create: %s", vmm_last_error());
  vmm_kv_layout l;
  CHECK(vmm_kv_get_layout(kv, &l) == VMM_SUCCESS, "layout");
  CHECK(l.token_bytes == 256 && l.page_size == 2 * MiB && l.seq_stride == 4 * MiB && l.buffer_stride == 16 * MiB &&
            l.reserved == 6 * 16 * MiB && l.layers == 3 && l.max_tokens == 10000 && l.tokens_per_page == 8192,
        "layout: T %zu S %zu B %zu reserved %zu", l.token_bytes, l.seq_stride, l.buffer_stride, l.reserved);

  size_t s0 = 99, s1 = 99, old = 99;
  CHECK(vmm_kv_open(kv, &s0) == VMM_SUCCESS && s0 == 0, "open -> 0");
  CHECK(vmm_kv_open_slot(kv, 2) == VMM_SUCCESS, "open slot 2");
  CHECK(vmm_kv_open_slot(kv, 2) == VMM_ERROR_INVALID_VALUE && has("already open"), "%s", vmm_last_error());
  CHECK(vmm_kv_open(kv, &s1) == VMM_SUCCESS && s1 == 1, "open -> 1 (lowest free)");
  CHECK(vmm_kv_append(kv, s0, 9000, &old) == VMM_SUCCESS && old == 0, "append 9000: %s", vmm_last_error());
  CHECK(vmm_kv_append(kv, s0, 5, &old) == VMM_SUCCESS && old == 9000, "append 5 -> old 9000");
  CHECK(vmm_kv_append(kv, s0, 996, NULL) == VMM_ERROR_OUT_OF_MEMORY && has("exceed max_tokens 10000"), "%s",
        vmm_last_error());
  vmm_kv_seq_info si;
  CHECK(vmm_kv_get_seq(kv, s0, &si) == VMM_SUCCESS && si.open == 1 && si.length == 9005 && si.mapped_pages == 2 &&
            si.capacity == 10000,
        "seq 0: open %d length %zu pages %zu capacity %zu", si.open, si.length, si.mapped_pages, si.capacity);
  CHECK(vmm_kv_get_seq(kv, 3, &si) == VMM_SUCCESS && si.open == 0 && si.length == 0, "free slot 3");
  CHECK(vmm_kv_get_seq(kv, 4, &si) == VMM_ERROR_INVALID_VALUE && has("out of range"), "%s", vmm_last_error());

  /* k(s, l) = base + 2 l B + s S; v one buffer further. The bytes are real host memory. */
  void *k = NULL, *v = NULL;
  CHECK(vmm_kv_k(kv, s0, 2, &k) == VMM_SUCCESS && vmm_kv_v(kv, s0, 2, &v) == VMM_SUCCESS, "k/v");
  CHECK((char*)k == (char*)l.base + 4 * l.buffer_stride + s0 * l.seq_stride &&
            (char*)v == (char*)l.base + 5 * l.buffer_stride + s0 * l.seq_stride,
        "addresses");
  memset((char*)k + 9004 * l.token_bytes, 0x11, l.token_bytes);  /* token 9004: on the second page */
  CHECK(vmm_kv_k(kv, s0, 3, &k) == VMM_ERROR_INVALID_VALUE, "layer 3 of 3: %s", vmm_last_error());
  CHECK(vmm_kv_k(kv, s0, 0, NULL) == VMM_ERROR_INVALID_VALUE, "NULL out");

  vmm_kv_stats st;
  CHECK(vmm_kv_get_stats(kv, &st) == VMM_SUCCESS && st.pages_mapped == 2 * 6 && st.open_seqs == 3 &&
            st.live_handles == 12 && st.live_mappings == 12 && st.used_bytes == 9005 * 256 * 6,
        "stats: mapped %zu open %zu live %zu used %zu", st.pages_mapped, st.open_seqs, st.live_handles, st.used_bytes);
  CHECK(vmm_kv_truncate(kv, s0, 100) == VMM_SUCCESS, "truncate");
  CHECK(vmm_kv_truncate(kv, s0, 200) == VMM_ERROR_INVALID_VALUE, "truncate past the length: %s", vmm_last_error());
  CHECK(vmm_kv_close(kv, s0) == VMM_SUCCESS && vmm_kv_close(kv, 2) == VMM_SUCCESS && vmm_kv_close(kv, s1) == VMM_SUCCESS,
        "close");
  CHECK(vmm_kv_append(kv, s0, 1, NULL) == VMM_ERROR_INVALID_VALUE && has("sequence 0 is not open"), "%s",
        vmm_last_error());
  CHECK(vmm_kv_close(kv, s0) == VMM_ERROR_INVALID_VALUE, "close twice");
  size_t released = 0;
  CHECK(vmm_kv_trim(kv, 0, &released) == VMM_SUCCESS && released == 12, "trim released %zu", released);
  CHECK(vmm_kv_get_stats(kv, &st) == VMM_SUCCESS && st.live_handles == 0 && st.live_mappings == 0 &&
            st.live_reservations == 1 && st.pages_mapped == 0,
        "back to zero: %zu handles, %zu mappings", st.live_handles, st.live_mappings);

  /* Every slot open: open() refuses with out of memory, and the slots stay as they were. */
  size_t s;
  for (int n = 0; n < 4; ++n) CHECK(vmm_kv_open(kv, &s) == VMM_SUCCESS, "open %d", n);
  CHECK(vmm_kv_open(kv, &s) == VMM_ERROR_OUT_OF_MEMORY && has("sequence slots"), "%s", vmm_last_error());
  CHECK(vmm_kv_get_stats(kv, &st) == VMM_SUCCESS && st.open_seqs == 4, "4 open");
  CHECK(vmm_kv_wait_map_ahead(kv) == VMM_SUCCESS, "wait_map_ahead without the thread");
  vmm_kv_destroy(kv);
  vmm_kv_destroy(NULL);
  CHECK(vmm_kv_open(NULL, &s) == VMM_ERROR_INVALID_VALUE && has("kv cache is NULL"), "%s", vmm_last_error());

  /* per_sequence: one buffer per sequence (2 layers: R = 4 x 256 B, 2048 tokens a page), a shared
     prefix mapped again. */
  {
    vmm_kv_config q = c;
    q.layers = 2;
    q.layout = 7;
    CHECK(vmm_kv_create(&q, &kv) == VMM_ERROR_INVALID_VALUE && has("VMM_KV_PER_SEQUENCE"), "%s", vmm_last_error());
    q.layout = VMM_KV_PER_SEQUENCE;
    CHECK(vmm_kv_create(&q, &kv) == VMM_SUCCESS, "create per_sequence: %s", vmm_last_error());
    CHECK(vmm_kv_get_layout(kv, &l) == VMM_SUCCESS && l.layout == VMM_KV_PER_SEQUENCE && l.token_stride == 4 * 256 &&
              l.layer_stride == 2 * 256 && l.kv_stride == 256 && l.tokens_per_page == 2048,
          "per_sequence layout: R %zu", l.token_stride);
    size_t a = 9, b = 9;
    CHECK(vmm_kv_open(kv, &a) == VMM_SUCCESS && vmm_kv_append(kv, a, 3000, NULL) == VMM_SUCCESS, "append");
    CHECK(vmm_kv_k(kv, a, 1, &k) == VMM_SUCCESS && (char*)k == (char*)l.base + a * l.seq_stride + 2 * 256, "k(a, 1)");
    memset((char*)k + 100 * l.token_stride, 0x5a, 256);
    CHECK(vmm_kv_share_prefix(kv, a, 3001, &b) == VMM_ERROR_INVALID_VALUE && has("has 3000 tokens"), "%s",
          vmm_last_error());
    CHECK(vmm_kv_share_prefix(kv, a, 3000, NULL) == VMM_ERROR_INVALID_VALUE, "NULL seq");
    CHECK(vmm_kv_share_prefix(kv, a, 3000, &b) == VMM_SUCCESS && b == 1, "share: %s", vmm_last_error());
    CHECK(vmm_kv_get_seq(kv, b, &si) == VMM_SUCCESS && si.length == 3000 && si.shared_tokens == 2048,
          "shared tokens %zu", si.shared_tokens);
    void* kb = NULL;
    CHECK(vmm_kv_k(kv, b, 1, &kb) == VMM_SUCCESS && ((unsigned char*)kb)[100 * l.token_stride] == 0x5a, "same bytes");
    CHECK(vmm_kv_get_stats(kv, &st) == VMM_SUCCESS && st.pages_aliased == 1 && st.pages_mapped == 2 + 1 &&
              st.live_mappings == 4,
          "aliased %zu mapped %zu", st.pages_aliased, st.pages_mapped);
    CHECK(vmm_kv_close(kv, a) == VMM_SUCCESS && ((unsigned char*)kb)[100 * l.token_stride] == 0x5a, "kept by b");
    vmm_kv_destroy(kv);
  }

  /* Physical memory: 6 pages fit, the 2nd page of a sequence needs 6 more: refused, rolled back. */
  c.host_physical_limit = 6 * 2 * MiB;
  CHECK(vmm_kv_create(&c, &kv) == VMM_SUCCESS, "limited: %s", vmm_last_error());
  CHECK(vmm_kv_open(kv, &s) == VMM_SUCCESS && vmm_kv_append(kv, s, 8192, NULL) == VMM_SUCCESS, "one page each");
  CHECK(vmm_kv_append(kv, s, 1, NULL) == VMM_ERROR_OUT_OF_MEMORY, "the 2nd page does not fit");
  CHECK(vmm_kv_get_stats(kv, &st) == VMM_SUCCESS && st.live_handles == 6 && st.pages_mapped == 6 &&
            vmm_kv_get_seq(kv, s, &si) == VMM_SUCCESS && si.length == 8192,
        "rolled back: %zu handles, length %zu", st.live_handles, si.length);
  vmm_kv_destroy(kv);

  /* fused_kv: one buffer per layer (K and V laid out by the caller); v refused. */
  c.host_physical_limit = 0;
  c.fused_kv = 1;
  CHECK(vmm_kv_create(&c, &kv) == VMM_SUCCESS && vmm_kv_get_layout(kv, &l) == VMM_SUCCESS &&
            l.reserved == 3 * l.buffer_stride,
        "fused_kv: reserved %zu = 3 buffers of %zu", l.reserved, l.buffer_stride);
  CHECK(vmm_kv_open(kv, &s) == VMM_SUCCESS && vmm_kv_append(kv, s, 8193, NULL) == VMM_SUCCESS &&
            vmm_kv_get_stats(kv, &st) == VMM_SUCCESS && st.pages_mapped == 2 * 3,
        "fused_kv: 2 pages in each of 3 buffers (%zu)", st.pages_mapped);
  CHECK(vmm_kv_k(kv, s, 1, &k) == VMM_SUCCESS && (char*)k == (char*)l.base + l.buffer_stride + s * l.seq_stride,
        "fused_kv: k(s, 1) = base + B + s S");
  CHECK(vmm_kv_v(kv, s, 0, &v) == VMM_ERROR_INVALID_VALUE && has("fused_kv"), "%s", vmm_last_error());
  vmm_kv_destroy(kv);
}

int main(void) {
  buffer_cases();
  kv_cases();
  if (failures) {
    printf("%d FAILED\n", failures);
    return 1;
  }
  printf("c api: all passed\n");
  return 0;
}
