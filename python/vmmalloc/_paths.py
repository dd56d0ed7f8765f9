# SPDX-License-Identifier: Apache-2.0
"""Where the package looks first for libvmmalloc.so and libvmmalloc_torch.so: folders relative to
this package's folder. Empty in the source tree (the loader then uses $VMMALLOC_LIB_DIR and the
repository's build folders); an installed package gets a generated copy naming the install's
library folder."""

LIB_DIRS = []
