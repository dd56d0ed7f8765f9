# SPDX-License-Identifier: Apache-2.0
"""The integration scripts' check: each check printed, the failed ones collected in `failures`."""

failures = []


def expect(cond, what):
    print(("ok    " if cond else "FAIL  ") + what, flush=True)
    if not cond:
        failures.append(what)
