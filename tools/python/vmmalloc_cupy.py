# SPDX-License-Identifier: Apache-2.0
"""The old name of vmmalloc.cupy (python/vmmalloc/cupy.py): `import vmmalloc_cupy` gives that
module itself."""

import os
import sys

_PKG_ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
if os.path.isdir(os.path.join(_PKG_ROOT, "vmmalloc")) and _PKG_ROOT not in sys.path:
    sys.path.insert(0, _PKG_ROOT)

import vmmalloc.cupy as _module  # noqa: E402

sys.modules[__name__] = _module
