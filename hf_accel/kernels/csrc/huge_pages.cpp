// Weights the decode kernels stream, copied into memory backed by transparent huge pages (2 MiB).
//
// Why: a decode step reads every weight byte once. On 4 KiB pages that is a TLB miss every 4 KiB, and under a
// hypervisor each miss is a two-level page walk; on such a machine a plain read loop ran at 60% of the rate it reached
// on huge pages (docs/weight-quantization.md has the figures). llama.cpp's mmap of its GGUF file gets large pages from
// the page cache; torch's allocator gives 4 KiB ones unless THP is "always" (or THP_MEM_ALLOC_ENABLE is set).
//
// huge_page_copy(Tensor t) -> Tensor   a contiguous copy of CPU tensor t in a huge-page slab (t itself where the
//                                      build has no mmap). Same dtype, shape and values.
//
// Slabs: copies are laid one after another (64-byte aligned) in anonymous mappings of kSlab bytes that start on a
// 2 MiB boundary and are madvise(MADV_HUGEPAGE)'d before any page is touched (with THP "never" they are ordinary
// pages: nothing fails). A copy past kSlab / 4 gets a slab of its own. Each copy is its own storage, holding a
// reference to its slab; a slab is unmapped when its last copy dies, so a model's weights go back to the system with
// the model. The allocator keeps only a weak reference to the slab it fills.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>

#if defined(__linux__)
#include <sys/mman.h>
#define HF_ACCEL_HUGE_PAGES 1
#endif

namespace {

#ifdef HF_ACCEL_HUGE_PAGES
constexpr size_t kHugePage = size_t(1) << 21;
constexpr size_t kSlab = size_t(64) << 20;
constexpr size_t kAlign = 64;

inline size_t round_up(size_t value, size_t to) { return (value + to - 1) / to * to; }

// One mapping of `length` bytes at a 2 MiB boundary.
struct Slab {
  char* base = nullptr;
  size_t length = 0;
  explicit Slab(size_t bytes) : length(round_up(bytes, kHugePage)) {
    // map one huge page more than asked, then give back the head and tail around the aligned range
    const size_t mapped = length + kHugePage;
    void* raw = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(raw != MAP_FAILED, "huge_page_copy: mmap of ", mapped, " bytes failed");
    char* start = reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(raw), kHugePage));
    const size_t head = start - static_cast<char*>(raw), tail = mapped - head - length;
    if (head > 0) munmap(raw, head);
    if (tail > 0) munmap(start + length, tail);
    madvise(start, length, MADV_HUGEPAGE);  // best effort: the pages stay ordinary where THP is off
    base = start;
  }
  ~Slab() { munmap(base, length); }
  Slab(const Slab&) = delete;
  Slab& operator=(const Slab&) = delete;
};

// The slab being filled and how far; copies too large for a shared slab get their own.
class SlabAllocator {
 public:
  // `bytes` in a slab, and the slab that must outlive them.
  std::pair<char*, std::shared_ptr<Slab>> allocate(size_t bytes) {
    bytes = round_up(std::max<size_t>(bytes, 1), kAlign);
    if (bytes > kSlab / 4) {
      auto own = std::make_shared<Slab>(bytes);
      return {own->base, own};
    }
    std::lock_guard<std::mutex> guard(mutex_);
    std::shared_ptr<Slab> slab = current_.lock();
    if (slab == nullptr || used_ + bytes > slab->length) {  // dead (its copies freed) or full: a fresh one
      slab = std::make_shared<Slab>(kSlab);
      current_ = slab;
      used_ = 0;
    }
    char* at = slab->base + used_;
    used_ += bytes;
    return {at, slab};
  }

 private:
  std::mutex mutex_;
  std::weak_ptr<Slab> current_;
  size_t used_ = 0;
};

SlabAllocator& allocator() {
  static SlabAllocator instance;
  return instance;
}
#endif

at::Tensor huge_page_copy(const at::Tensor& tensor) {
  TORCH_CHECK(tensor.device().is_cpu(), "huge_page_copy: a CPU tensor, got one on ", tensor.device());
#ifdef HF_ACCEL_HUGE_PAGES
  const at::Tensor source = tensor.contiguous();
  auto [data, slab] = allocator().allocate(source.nbytes());
  at::Tensor copy = at::from_blob(data, source.sizes(), [slab](void*) mutable { slab.reset(); }, source.options());
  if (source.nbytes() > 0) std::memcpy(data, source.data_ptr(), source.nbytes());
  return copy;
#else
  return tensor.contiguous();
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_accel, m) { m.def("huge_page_copy(Tensor tensor) -> Tensor"); }

TORCH_LIBRARY_IMPL(hf_accel, CPU, m) { m.impl("huge_page_copy", &huge_page_copy); }
