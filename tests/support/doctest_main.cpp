// SPDX-License-Identifier: Apache-2.0
// The main of the host test programs that need no main of their own (vmm_doctest_main).
#include <doctest/doctest.h>

int main(int argc, char** argv) { return doctest::Context(argc, argv).run(); }
