# Folders holding vmmalloc's shared libraries, relative to this package's folder (tried first) or
# absolute. Empty in the source tree; cmake --install writes the installed libdir here.
LIB_DIRS = []
