// A cache in front of CPython's arena allocator (PyObject_SetArenaAllocator), which hands
// out both pymalloc's arenas and the 16 KiB chunks of the interpreter's frame stack. By
// default each is an mmap of its own and goes back with munmap as soon as it empties: a
// loop whose call depth crosses a chunk boundary maps and unmaps a chunk on every pass.
// Each munmap flushes the TLBs of every core the process runs on (an inter-processor
// interrupt) and the next mmap faults its pages in zeroed again. Kept
// here instead, up to kSlots blocks of at most kMaxKeptBytes, a block comes back as it was.
//
// No Python headers (images without them build this too): the allocator struct is
// declared below with CPython's layout, and pdserve installs it through ctypes. Every
// call runs under the GIL (pymalloc and frame pushes hold it), so nothing here locks.
#include <cstddef>
#include <cstdint>

namespace {

struct ArenaAllocator {  // CPython's PyObjectArenaAllocator
  void* ctx;
  void* (*alloc)(void* ctx, size_t size);
  void (*free)(void* ctx, void* ptr, size_t size);
};

constexpr int kSlots = 16;
constexpr size_t kMaxKeptBytes = size_t{1} << 20;  // pymalloc's arena on 64-bit builds

struct ArenaCache {
  ArenaAllocator original;  // first: the installer fills it with PyObject_GetArenaAllocator
  void* kept[kSlots];
  size_t kept_bytes[kSlots];
  uint64_t num_reused;       // allocations served from kept blocks
  uint64_t num_passed_on;    // allocations the original allocator made
  uint64_t num_released;     // frees passed on (the cache was full or the block too big)
};

ArenaCache cache;

}  // namespace

extern "C" {

void* pdserve_arena_cache_alloc(void* ctx, size_t size) {
  auto* c = static_cast<ArenaCache*>(ctx);
  for (int i = 0; i < kSlots; ++i) {
    if (c->kept[i] != nullptr && c->kept_bytes[i] == size) {
      void* block = c->kept[i];
      c->kept[i] = nullptr;
      ++c->num_reused;
      return block;
    }
  }
  ++c->num_passed_on;
  return c->original.alloc(c->original.ctx, size);
}

void pdserve_arena_cache_free(void* ctx, void* ptr, size_t size) {
  auto* c = static_cast<ArenaCache*>(ctx);
  if (ptr == nullptr) return;
  if (size <= kMaxKeptBytes) {
    for (int i = 0; i < kSlots; ++i) {
      if (c->kept[i] == nullptr) {
        c->kept[i] = ptr;
        c->kept_bytes[i] = size;
        return;
      }
    }
  }
  ++c->num_released;
  c->original.free(c->original.ctx, ptr, size);
}

// The cache's state: its ctx for the allocator struct, and where the installer writes the
// original allocator.
void* pdserve_arena_cache_context() { return &cache; }

// [reused, passed on, released]
void pdserve_arena_cache_counts(uint64_t* out) {
  out[0] = cache.num_reused;
  out[1] = cache.num_passed_on;
  out[2] = cache.num_released;
}

}  // extern "C"
