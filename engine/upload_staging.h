// A GPU backend's small host-to-device copies, queued behind the kernels instead of waited for.
//
// A copy from pageable host memory makes the host wait until the device has run every kernel
// launched before it, since the runtime copies only then. A decode step's ops each upload a few
// small operands (the token's positions, block tables, the picks' rows), so such copies drained
// the device's queue at most ops, and every launch's latency was paid in full. Here an upload of
// up to `largest` bytes is copied into pinned staging and queued on the kernels' stream, and the
// host goes on at once. A staging byte is written again only after the device has done the copy
// that read it: after a wait for the device, which the caller reports by Drained(), or this
// class's own wait when the staging is full. Larger uploads (a prompt's activations, weights)
// stay plain copies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace flashd::engine {

// Device: the runtime's calls, each giving "" or the error:
//   std::string HostAlloc(void** ptr, size_t bytes);  // pinned host memory
//   void HostFree(void* ptr);
//   std::string Queue(void* dst, const void* pinned, size_t bytes);  // the host not waiting
//   std::string Copy(void* dst, const void* src, size_t bytes);      // the host waiting
//   std::string Wait();  // every queued copy done
template <class Device>
class UploadStaging {
 public:
  UploadStaging(Device device, size_t capacity, size_t largest)
      : device_(device), capacity_(capacity), largest_(largest) {}
  UploadStaging(const UploadStaging&) = delete;
  UploadStaging& operator=(const UploadStaging&) = delete;
  // Waits for the copies still reading the staging before it is freed.
  ~UploadStaging() {
    if (buffer_ == nullptr) return;
    if (used_ > 0) (void)device_.Wait();
    device_.HostFree(buffer_);
  }

  // `bytes` at `src` to the device's `dst` in stream order. The bytes are taken as they are now:
  // the caller may change them once this returns.
  std::string Up(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return "";
    const size_t size = (bytes + kAlign - 1) / kAlign * kAlign;
    if (size > largest_ || size > capacity_ || !Ready()) {
      ++copied_;
      return device_.Copy(dst, src, bytes);
    }
    if (used_ + size > capacity_) {
      ++waits_;
      if (std::string e = device_.Wait(); !e.empty()) return e;
      used_ = 0;
    }
    uint8_t* staged = buffer_ + used_;
    std::memcpy(staged, src, bytes);
    used_ += size;
    ++queued_;
    return device_.Queue(dst, staged, bytes);
  }

  // Uploads of more than `largest` bytes are plain copies from now on (0: all of them).
  void set_largest(size_t largest) { largest_ = largest; }

  // The device has done every copy queued so far (the caller waited for it, or read from it
  // with a copy that waits): all of the staging may be written again.
  void Drained() { used_ = 0; }

  uint64_t queued() const { return queued_; }  // Uploads queued from the staging.
  uint64_t copied() const { return copied_; }  // Uploads copied while the host waited.
  uint64_t waits() const { return waits_; }    // Waits for a full staging.

 private:
  static constexpr size_t kAlign = 256;

  // The staging, allocated at the first upload (none: every upload is a plain copy).
  bool Ready() {
    if (!tried_) {
      tried_ = true;
      void* p = nullptr;
      if (device_.HostAlloc(&p, capacity_).empty()) buffer_ = static_cast<uint8_t*>(p);
    }
    return buffer_ != nullptr;
  }

  Device device_;
  size_t capacity_, largest_;
  uint8_t* buffer_ = nullptr;
  bool tried_ = false;
  size_t used_ = 0;
  uint64_t queued_ = 0, copied_ = 0, waits_ = 0;
};

}  // namespace flashd::engine
