// ipc: see include/vmmalloc/ipc.hpp (being written)
