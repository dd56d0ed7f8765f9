// SPDX-License-Identifier: Apache-2.0
// The Vulkan side of the interop alone, on the first Vulkan device (any vendor, lavapipe too):
// buffers, opaque-fd export and re-import, timeline semaphores, submissions, argument checks.
// Exits 77 without a loader or a device.
#include <vulkan/vulkan.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "vk_test_main.hpp"

using namespace std::chrono_literals;
using vmm::errc;
using vmm::vk::buffer_kind;
using vmm::vk::semaphore_kind;
using vktest::ctx;

namespace {

errc kind_of_throw(const std::function<void()>& f) {
  try {
    f();
  } catch (const vmm::error& e) {
    return e.st().kind;
  }
  return errc::ok;
}

bool fd_open(int fd) { return fd >= 0 && ::fcntl(fd, F_GETFD) != -1; }

// Copies [off, off + n) of `b` into a host-visible buffer and returns its bytes.
std::vector<std::uint32_t> read_back(const vmm::vk::buffer& b, std::uint64_t off, std::uint64_t n) {
  auto host = ctx().create_buffer(n, buffer_kind::host_visible);
  auto s = ctx().submit([&](VkCommandBuffer cb) { ctx().cmd_copy(cb, b, off, host, 0, n); });
  REQUIRE(s.wait(10s));
  std::vector<std::uint32_t> v(n / 4);
  std::memcpy(v.data(), host.mapped(), n);
  return v;
}

std::size_t count_not(const std::vector<std::uint32_t>& v, std::uint32_t x) {
  std::size_t k = 0;
  for (auto w : v) k += w != x;
  return k;
}

}  // namespace

TEST_CASE("fill and read back through a host-visible buffer") {
  auto dev = ctx().create_buffer(65536, buffer_kind::device_local);
  CHECK(dev.allocation_size() >= 65536);
  auto s = ctx().submit([&](VkCommandBuffer cb) {
    ctx().cmd_fill(cb, dev, 0, 65536, 0);
    ctx().cmd_barrier(cb);
    ctx().cmd_fill(cb, dev, 4096, 4096, 0xA5A5A5A5u);
  });
  REQUIRE(s.wait(10s));
  CHECK(s.done());
  auto v = read_back(dev, 0, 65536);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < v.size(); ++i) bad += v[i] != ((i >= 1024 && i < 2048) ? 0xA5A5A5A5u : 0u);
  CHECK(bad == 0);
}

TEST_CASE("opaque fd: an exported buffer re-imported on the same device shares the memory") {
  for (bool dedicated : {false, true}) {
    CAPTURE(dedicated);
    vmm::vk::buffer exp;
    try {
      exp = ctx().create_buffer(1 << 20, buffer_kind::exportable, dedicated);
    } catch (const vmm::error& e) {
      if (e.st().kind != errc::not_supported) throw;
      MESSAGE("opaque fd export not supported here: " << e.what());
      return;
    }
    CHECK(exp.dedicated() >= dedicated);
    const int fd = exp.export_fd();
    REQUIRE(fd >= 0);
    vmm::vk::buffer imp = ctx().import_fd(fd, exp.allocation_size());
    CHECK(fd_open(fd));  // the fd rule: the caller's fd stays the caller's
    ::close(fd);
    CHECK(imp.allocation_size() == exp.allocation_size());
    auto s = ctx().submit([&](VkCommandBuffer cb) { ctx().cmd_fill(cb, imp, 0, 1 << 20, 0x5EED0000u + dedicated); });
    REQUIRE(s.wait(10s));
    CHECK(count_not(read_back(exp, 0, 1 << 20), 0x5EED0000u + dedicated) == 0);
  }
}

TEST_CASE("import_fd and create_buffer reject bad arguments") {
  CHECK(kind_of_throw([] { ctx().import_fd(-1, 4096); }) == errc::invalid_value);
  CHECK(kind_of_throw([] { ctx().create_buffer(0, buffer_kind::host_visible); }) == errc::invalid_value);
  int closed = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  ::close(closed);
  const errc k = kind_of_throw([&] { ctx().import_fd(closed, 1 << 20); });
  CHECK((k == errc::invalid_value || k == errc::not_supported));
  vmm::ipc::export_handle h;  // empty: not a posix_fd export
  CHECK(kind_of_throw([&] { ctx().import_chunks(h); }) == errc::invalid_value);
  auto b = ctx().create_buffer(4096, buffer_kind::device_local);
  CHECK(kind_of_throw([&] { b.export_fd(); }) == errc::invalid_value);  // not exportable
  auto s = ctx().submit([&](VkCommandBuffer cb) {
    CHECK(kind_of_throw([&] { ctx().cmd_fill(cb, b, 2, 4, 0); }) == errc::invalid_value);     // offset % 4
    CHECK(kind_of_throw([&] { ctx().cmd_fill(cb, b, 0, 8192, 0); }) == errc::invalid_value);  // past the end
    CHECK(kind_of_throw([&] { ctx().cmd_copy(cb, b, 4000, b, 0, 200); }) == errc::invalid_value);
  });
  CHECK(s.wait(10s));
}

TEST_CASE("timeline semaphore: a submission waits for the host's signal") {
  if (!ctx().info().timeline) {
    MESSAGE("no timeline semaphores on this device");
    return;
  }
  auto tl = ctx().create_semaphore(semaphore_kind::timeline, 0, false);
  CHECK(tl.value() == 0);
  // A host-visible target: the host reads it while the queue is blocked (a read-back submission
  // would queue behind the blocked one).
  auto b = ctx().create_buffer(4096, buffer_kind::host_visible);
  auto words = [&] {
    std::vector<std::uint32_t> v(1024);
    std::memcpy(v.data(), b.mapped(), 4096);
    return v;
  };
  auto first = ctx().submit([&](VkCommandBuffer cb) { ctx().cmd_fill(cb, b, 0, 4096, 1); });
  REQUIRE(first.wait(10s));
  auto s = ctx().submit([&](VkCommandBuffer cb) { ctx().cmd_fill(cb, b, 0, 4096, 2); }, {{&tl, 1}}, {{&tl, 2}});
  CHECK_FALSE(s.wait(50ms));  // blocked on value 1
  CHECK_FALSE(s.done());
  CHECK_FALSE(tl.wait(2, 1ms));
  CHECK(count_not(words(), 1) == 0);  // the fill has not run
  tl.signal(1);
  REQUIRE(s.wait(10s));
  CHECK(tl.wait(2, 1s));
  CHECK(tl.value() == 2);
  CHECK(count_not(words(), 2) == 0);
  // Submission argument checks.
  CHECK(kind_of_throw([&] { ctx().submit({}, {}, {{&tl, 0}}); }) == errc::invalid_value);  // signal 0
  auto bin = ctx().create_semaphore(semaphore_kind::binary, 0, false);
  CHECK(kind_of_throw([&] { ctx().submit({}, {}, {{&bin, 3}}); }) == errc::invalid_value);
  CHECK(kind_of_throw([&] { bin.signal(1); }) == errc::invalid_value);  // host signal: timeline only
  CHECK(kind_of_throw([&] { ctx().create_semaphore(semaphore_kind::binary, 5, false); }) == errc::invalid_value);
}

TEST_CASE("exportable semaphores give fds") {
  if (!ctx().info().semaphore_fd) {
    MESSAGE("no VK_KHR_external_semaphore_fd on this device");
    CHECK(kind_of_throw([] { ctx().create_semaphore(semaphore_kind::binary); }) == errc::not_supported);
    return;
  }
  auto bin = ctx().create_semaphore(semaphore_kind::binary);
  const int fd = bin.export_fd();
  CHECK(fd_open(fd));
  ::close(fd);
}

int main(int argc, char** argv) {
  return vktest::run(argc, argv, [] { return vmm::vk::context::open(); });
}
