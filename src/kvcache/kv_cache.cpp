// kv_cache: see include/vmmalloc/kv_cache.hpp (being written)
