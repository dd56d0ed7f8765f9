// SPDX-License-Identifier: Apache-2.0
// Whether this is the TSan tree. A test case that runs on one thread skips there
// (`* doctest::skip(vmm::test::under_tsan)`): TSan has no race to find in it, and its page faults
// and checked stores make such a case take a minute; the plain and ASan trees run it.
#pragma once

namespace vmm::test {

#if defined(__SANITIZE_THREAD__)
inline constexpr bool under_tsan = true;
#else
inline constexpr bool under_tsan = false;
#endif

}  // namespace vmm::test
