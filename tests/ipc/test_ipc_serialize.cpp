// SPDX-License-Identifier: Apache-2.0
// IPC handle serialisation: round trips, byte identity, and every malformed input refused.
#include <doctest/doctest.h>

#include <random>
#include <string>

#include "ipc_test_util.hpp"
#include "vmmalloc/ipc.hpp"
#include "vmmalloc/vmmalloc.hpp"

using namespace vmm;
using ipc::export_handle;

namespace {

constexpr std::uint64_t MiB = 1 << 20;

export_handle sample(ipc_kind k = ipc_kind::posix_fd, std::size_t nchunks = 3) {
  export_handle h;
  h.kind = k;
  h.device = 3;
  h.offset = 4096;
  for (std::size_t i = 0; i < nchunks; ++i) {
    ipc::exported_chunk c;
    c.size = (i + 1) * 2 * MiB;
    c.handle.kind = k;
    if (k == ipc_kind::fabric)
      for (std::size_t b = 0; b < c.handle.fabric.size(); ++b) c.handle.fabric[b] = static_cast<std::uint8_t>(b * 7 + i);
    h.chunks.push_back(std::move(c));
  }
  h.size = h.mapping_size() - h.offset - 100;
  return h;
}

// Writes v little-endian at bytes[at].
void poke32(std::vector<std::uint8_t>& b, std::size_t at, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) b[at + i] = static_cast<std::uint8_t>(v >> (8 * i));
}
void poke64(std::vector<std::uint8_t>& b, std::size_t at, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) b[at + i] = static_cast<std::uint8_t>(v >> (8 * i));
}

// try_deserialize refuses `bytes` with invalid_value and reason `name`; deserialize throws the same.
void refused(const std::vector<std::uint8_t>& bytes, const char* name) {
  CAPTURE(name);
  export_handle out;
  std::string why;
  status s = ipc::try_deserialize(bytes, out, &why);
  CHECK_FALSE(s.ok());
  CHECK(s.kind == errc::invalid_value);
  CHECK(std::string(s.name) == name);
  CHECK(why.find("vmm::ipc::deserialize") == 0);
  CHECK(out.chunks.empty());  // nothing half-filled
  try {
    (void)ipc::deserialize(bytes);
    FAIL("deserialize accepted a malformed handle");
  } catch (const vmm::error& e) {
    CHECK(std::string(e.what()) == why);
    CHECK(e.st().kind == errc::invalid_value);
  }
}

}  // namespace

TEST_CASE("serialize: layout is fixed little endian, fields written one by one") {
  export_handle h = sample();
  auto b = ipc::serialize(h);
  REQUIRE(b.size() == ipc::header_bytes + 3 * 16);
  CHECK(std::string(b.begin(), b.begin() + 4) == "VMIP");
  CHECK(b[4] == 1);  // version 1, little endian
  CHECK(b[5] == 0);
  CHECK(b[8] == static_cast<std::uint8_t>(ipc_kind::posix_fd));
  CHECK(b[12] == 3);  // device
  CHECK(b[24] == 0x00);
  CHECK(b[25] == 0x10);  // offset 4096 = 0x1000
  CHECK(b[32] == 3);     // chunk count
  CHECK(b[ipc::header_bytes + 2] == 0x20);  // first chunk 2 MiB = 0x200000
  for (int i : {9, 10, 11, 36, 37, 38, 39}) CHECK(b[i] == 0);  // reserved bytes zero
}

TEST_CASE("serialize: round trip keeps every field, fds travel out of band") {
  for (ipc_kind k : {ipc_kind::posix_fd, ipc_kind::fabric}) {
    CAPTURE(static_cast<int>(k));
    export_handle h = sample(k, 5);
    auto bytes = ipc::serialize(h);
    export_handle r = ipc::deserialize(bytes);
    CHECK(r.version == ipc::format_version);
    CHECK(r.kind == k);
    CHECK(r.device == 3);
    CHECK(r.size == h.size);
    CHECK(r.offset == h.offset);
    REQUIRE(r.chunks.size() == 5);
    for (std::size_t i = 0; i < 5; ++i) {
      CHECK(r.chunks[i].size == h.chunks[i].size);
      CHECK(r.chunks[i].handle.kind == k);
      CHECK(r.chunks[i].handle.fd == -1);  // fds are never in the bytes
      CHECK(r.chunks[i].handle.fabric == h.chunks[i].handle.fabric);
    }
    CHECK(ipc::serialize(r) == bytes);  // re-serialising gives the same bytes
    CHECK(r.fd_count() == (k == ipc_kind::posix_fd ? 5u : 0u));
  }
}

TEST_CASE("serialize: the same allocation gives byte-identical output (fd numbers not included)") {
  host_backend_options ho;
  ho.granularity = 64 << 10;
  auto b = make_backend<host_backend>(ho);
  ipct::host_allocation a(*b, {64 << 10, 128 << 10}, 1000, 100000, 7);
  export_handle h1 = a.export_handle();
  export_handle h2 = a.export_handle();
  REQUIRE(h1.chunks[0].handle.fd != h2.chunks[0].handle.fd);
  const auto s1 = ipc::serialize(h1), s2 = ipc::serialize(h2);
  CHECK(s1 == s2);
  std::vector<std::uint8_t> s3;
  CHECK(ipc::try_serialize(h1, s3).ok());
  CHECK(s3 == s1);
}

TEST_CASE("serialize: refuses a handle that is not valid") {
  export_handle none = sample();
  none.kind = ipc_kind::none;
  CHECK_THROWS_AS((void)ipc::serialize(none), vmm::error);
  export_handle empty;
  empty.kind = ipc_kind::posix_fd;
  empty.size = 1;
  std::vector<std::uint8_t> out{1, 2, 3};
  status s = ipc::try_serialize(empty, out);
  CHECK(s.kind == errc::invalid_value);
  CHECK(std::string(s.name) == "no chunks");
  CHECK(out == std::vector<std::uint8_t>{1, 2, 3});  // untouched
  export_handle beyond = sample();
  beyond.size = beyond.mapping_size();  // offset + size past the chunks
  try {
    (void)ipc::serialize(beyond);
    FAIL("serialize accepted offset + size beyond the chunks");
  } catch (const vmm::error& e) {
    CHECK(std::string(e.what()).find("exceeds the chunks") != std::string::npos);
  }
}

TEST_CASE("deserialize: every malformed input is refused with its reason") {
  const auto good = ipc::serialize(sample(ipc_kind::fabric, 2));
  REQUIRE(ipc::deserialize(good).chunks.size() == 2);

  refused({}, "truncated");
  for (std::size_t n = 1; n < good.size(); ++n) {  // every proper prefix
    CAPTURE(n);
    export_handle out;
    status s = ipc::try_deserialize(std::span(good).first(n), out);
    CHECK(s.kind == errc::invalid_value);
    CHECK(std::string(s.name) == "truncated");
  }
  auto b = good;
  b[0] ^= 1;
  refused(b, "bad magic");
  b = good;
  poke32(b, 4, 2);
  refused(b, "unsupported format version");
  b = good;
  poke32(b, 4, 0);
  refused(b, "unsupported format version");
  for (std::uint8_t k : {0, 3, 255}) {
    b = good;
    b[8] = k;
    refused(b, "bad handle kind");
  }
  b = good;
  b[10] = 1;
  refused(b, "reserved bytes set");
  b = good;
  b[39] = 1;
  refused(b, "reserved bytes set");
  b = good;
  b[ipc::header_bytes + 9] = 1;  // chunk record padding
  refused(b, "reserved bytes set");
  b = good;
  b[ipc::header_bytes + 8] = 0;  // chunk kind none
  refused(b, "bad chunk kind");
  b = good;
  poke32(b, 12, 0xFFFFFFFFu);  // device -1
  refused(b, "bad device");
  b = good;
  poke32(b, 32, 0);
  b.resize(ipc::header_bytes);
  refused(b, "no chunks");
  b = good;
  poke32(b, 32, ipc::max_chunks + 1);
  refused(b, "too many chunks");
  b = good;
  poke32(b, 32, 3);  // announces 3, carries 2
  refused(b, "truncated");
  b = good;
  b.push_back(0);
  refused(b, "trailing bytes");
  b = good;
  poke64(b, ipc::header_bytes, 0);  // chunk 0 of size 0
  refused(b, "empty chunk");
  b = good;
  poke64(b, 16, 0);  // size 0
  refused(b, "empty allocation");
  b = good;
  poke64(b, 24, 2 * MiB);  // offset == first chunk's size
  refused(b, "offset outside first chunk");
  b = good;
  poke64(b, 16, 6 * MiB);  // offset 4096 + 6 MiB > 2 + 4 MiB
  refused(b, "allocation beyond chunks");
  b = good;
  poke64(b, 16, ~std::uint64_t{0} - 10);  // offset + size wraps around
  refused(b, "allocation beyond chunks");
  b = good;
  poke64(b, ipc::header_bytes, ~std::uint64_t{0} - MiB);  // chunk sizes sum past 2^64
  refused(b, "chunk sizes overflow");
  b = good;
  poke64(b, 16, 100);  // the second chunk would hold nothing of the allocation
  refused(b, "chunk outside allocation");
}

TEST_CASE("deserialize: random corruption never crashes; what is accepted is valid") {
  const auto good = ipc::serialize(sample(ipc_kind::fabric, 3));
  std::mt19937_64 rng(12345);
  int accepted = 0;
  for (int it = 0; it < 20000; ++it) {
    auto b = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) b[rng() % b.size()] ^= static_cast<std::uint8_t>(1u << (rng() % 8));
    if (rng() % 8 == 0) b.resize(rng() % (b.size() + 8));
    export_handle h;
    if (ipc::try_deserialize(b, h).ok()) {
      ++accepted;
      CHECK(ipc::validate(h, false).ok());
      CHECK(ipc::serialize(h) == b);  // one byte sequence per handle
    }
  }
  MESSAGE("accepted " << accepted << " of 20000 mutations (fabric bytes / sizes that stay consistent)");
}
