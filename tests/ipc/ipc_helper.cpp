// SPDX-License-Identifier: Apache-2.0
// vmm_ipc_helper PATH SEED REPLY_SEED: the exec'd consumer of the fork + exec test.
// Connects to PATH, receives one handle, imports it on a host backend, checks the pattern of SEED,
// writes the pattern of REPLY_SEED, closes the import, checks that nothing is left (backend live
// counts, fd count), and sends 'D'. Exit 0 on success; a message and 1 otherwise.
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "ipc_test_util.hpp"
#include "vmmalloc/ipc.hpp"
#include "vmmalloc/vmmalloc.hpp"

namespace {

int run(const char* path, std::uint64_t seed, std::uint64_t reply) {
  using namespace vmm;
  auto b = make_backend<host_backend>();
  auto& hb = static_cast<backend_model<host_backend>&>(*b).get();
  ipc::unique_fd s = ipc::connect(path, 10000);
  const int base_fds = ipct::fd_count();
  {
    ipc::receive_options o;
    o.timeout_ms = 10000;
    ipc::imported m = ipc::import(*b, ipc::receive_handle(s.get(), o));
    CHILD_REQUIRE(m.mapping_size() % (2u << 20) == 0);
    const std::size_t bad = ipct::mismatches(m.get(), m.size(), seed);
    if (bad) std::fprintf(stderr, "vmm_ipc_helper: %zu of %zu bytes differ\n", bad, m.size());
    CHILD_REQUIRE(bad == 0);
    ipct::fill(m.get(), m.size(), reply);
  }
  CHILD_REQUIRE(hb.live_handles() == 0 && hb.live_mappings() == 0 && hb.live_reservations() == 0);
  CHILD_REQUIRE(ipct::fd_count() == base_fds);
  CHILD_REQUIRE(ipct::put(s.get(), 'D'));
  std::printf("vmm_ipc_helper: imported, verified and replied\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s SOCKET_PATH SEED REPLY_SEED\n", argv[0]);
    return 2;
  }
  try {
    return run(argv[1], std::strtoull(argv[2], nullptr, 10), std::strtoull(argv[3], nullptr, 10));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vmm_ipc_helper: %s\n", e.what());
    return 1;
  }
}
