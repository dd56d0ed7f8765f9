// SPDX-License-Identifier: Apache-2.0
// doctest main of the host IPC tests. SIGPIPE is ignored as a safety net: the library sends with
// MSG_NOSIGNAL and a test that still raised SIGPIPE would otherwise die silently.
#include <doctest/doctest.h>

#include <signal.h>

int main(int argc, char** argv) {
  ::signal(SIGPIPE, SIG_IGN);
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
