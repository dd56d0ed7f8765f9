// SPDX-License-Identifier: Apache-2.0
// doctest's implementation, compiled once per build tree for every host test program
// (vmm_doctest_impl): it is the costliest part of a test's build, ~10 s at -O2 and ~45 s under
// ASan + UBSan, where each program used to compile its own.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
