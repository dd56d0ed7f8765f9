# SPDX-License-Identifier: Apache-2.0
"""What GrowableBuffer and KVCache share: one owner of one native object.

_Handle holds the native pointer and frees it once, when the Python object and every view of its
memory are gone (views keep the handle, not the object). Owner is the object's side: a context
manager whose exit destroys it, never copied or pickled (a copy would free the reservation twice),
and every call through _ptr() checks that it was not destroyed."""

from ._lib import InvalidValueError, Status

__all__ = []


class _Handle(object):
    """Owns the native pointer: destroyed when the owner and every view of its memory are gone."""

    __slots__ = ("ptr", "destroy", "__weakref__")

    def __init__(self, ptr, destroy):
        self.ptr, self.destroy = ptr, destroy

    def free(self):
        if self.ptr:
            p, self.ptr = self.ptr, None
            self.destroy(p)

    def __del__(self):
        self.free()


class Owner(object):
    """Base of the classes that own a _Handle in self._h. _gone: what _ptr() says once destroyed."""

    _gone = "destroyed"

    def _free_handle(self):
        if self._h is not None:
            self._h.free()
            self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    def __copy__(self):
        raise TypeError("vmmalloc.%s cannot be copied: it owns its reservation" % type(self).__name__)

    def __deepcopy__(self, memo):
        raise TypeError("vmmalloc.%s cannot be copied: it owns its reservation" % type(self).__name__)

    def __reduce__(self):
        raise TypeError("vmmalloc.%s cannot be pickled: it owns its reservation" % type(self).__name__)

    @property
    def closed(self):
        return self._h is None or not self._h.ptr

    def _ptr(self, what):
        """The native pointer for the call `what`; InvalidValueError once destroyed."""
        if self.closed:
            raise InvalidValueError("vmmalloc.%s.%s: %s" % (type(self).__name__, what, self._gone), Status.INVALID_VALUE)
        return self._h.ptr
