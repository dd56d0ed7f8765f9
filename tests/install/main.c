// SPDX-License-Identifier: Apache-2.0
/* Consumer check, C API: allocate, write, free on the host backend; bad input is reported and
 * leaves the allocator intact. */
#include <stdio.h>
#include <string.h>

#include <vmmalloc/vmmalloc.h>

int main(void) {
  vmm_policy pol;
  vmm_allocator* a;
  void* p;
  vmm_stats s;

  vmm_policy_init(&pol);
  pol.backend = VMM_BACKEND_HOST;
  pol.reservation_size = (size_t)1 << 30;
  if (vmm_create(&pol, &a) != VMM_SUCCESS) {
    printf("consumer_c FAILED: vmm_create: %s\n", vmm_last_error());
    return 1;
  }
  p = vmm_malloc(a, 1 << 20);
  if (!p) {
    printf("consumer_c FAILED: vmm_malloc: %s\n", vmm_last_error());
    return 1;
  }
  memset(p, 0xab, 1 << 20);
  if (vmm_free(a, p) != VMM_SUCCESS || vmm_free(a, p) != VMM_ERROR_INVALID_POINTER ||
      vmm_check(a) != VMM_SUCCESS || vmm_get_stats(a, &s) != VMM_SUCCESS || s.live != 0) {
    printf("consumer_c FAILED: %s\n", vmm_last_error());
    return 1;
  }
  vmm_destroy(a);
  printf("consumer_c ok\n");
  return 0;
}
