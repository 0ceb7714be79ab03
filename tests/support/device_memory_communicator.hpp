// SPDX-License-Identifier: Apache-2.0
// A communicator that, like NCCL, accepts only device memory in its void* collectives: a test
// double that proves on the CPU that the runtime hands a device communicator nothing else.
//
// `tracked_device_space` is a simulated device that remembers its live blocks; a
// `device_memory_communicator` forwards every call to an in-process rank but first checks that each
// buffer of a void* collective lies inside a live block of some tracked device (in-process ranks
// share one address space), and throws `host_buffer_error`
// naming the call and the buffer otherwise (on NCCL that call would be an illegal address). The
// span<double> collectives, which every communicator runs on host memory, pass unchecked.
// `host_memory_communicator` is the reverse, an MPI without CUDA support: any void* buffer that
// touches a tracked device is a `device_buffer_error` (staged_communicator's inner side).
#pragma once
#include <chunkstar/comm/blocking_collectives.hpp>
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/memory/host_copy_engine.hpp>
#include <chunkstar/memory/simulated_device_space.hpp>
#include <chunkstar/memory/platform.hpp>

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>

namespace chunkstar::testing {

/** A simulated device that knows which addresses it handed out. */
class tracked_device_space {
 public:
  static constexpr memory_kind kind = memory_kind::device;
  explicit tracked_device_space(simulated_device_options o) : inner_(std::move(o)) {
    std::lock_guard lock(registry_mutex());
    registry().insert(this);
  }
  tracked_device_space(const tracked_device_space&) = delete;
  tracked_device_space& operator=(const tracked_device_space&) = delete;
  ~tracked_device_space() {
    std::lock_guard lock(registry_mutex());
    registry().erase(this);
  }
  /** True when [p, p + n) touches a live block of any tracked device. */
  [[nodiscard]] static bool any_overlaps(const void* p, std::size_t n) {
    std::lock_guard lock(registry_mutex());
    for (const auto* d : registry())
      if (d->overlaps(p, n)) return true;
    return false;
  }
  /** True when [p, p + n) lies inside a live block of any tracked device. */
  [[nodiscard]] static bool any_holds(const void* p, std::size_t n) {
    std::lock_guard lock(registry_mutex());
    for (const auto* d : registry())
      if (d->holds(p, n)) return true;
    return false;
  }
  void* allocate(std::size_t n, std::size_t a) { return note(inner_.allocate(n, a), n); }
  void* try_allocate(std::size_t n, std::size_t a) { return note(inner_.try_allocate(n, a), n); }
  void deallocate(void* p, std::size_t n, std::size_t a) noexcept {
    if (p == nullptr) return;
    {
      std::lock_guard lock(mutex_);
      blocks_.erase(address(p));
    }
    inner_.deallocate(p, n, a);
  }
  [[nodiscard]] std::size_t capacity() const { return inner_.capacity(); }
  [[nodiscard]] std::size_t used() const { return inner_.used(); }
  [[nodiscard]] space_usage usage() const { return inner_.usage(); }
  [[nodiscard]] const std::string& name() const { return inner_.name(); }
  /** True when [p, p + n) touches a live block. */
  [[nodiscard]] bool overlaps(const void* p, std::size_t n) const {
    std::lock_guard lock(mutex_);
    auto it = blocks_.lower_bound(address(p) + n);  // the first block starting at or after the end
    if (it == blocks_.begin()) return false;
    --it;
    return it->first + it->second > address(p);
  }
  /** True when [p, p + n) lies inside one live block (n = 0: always). */
  [[nodiscard]] bool holds(const void* p, std::size_t n) const {
    if (n == 0) return true;
    std::lock_guard lock(mutex_);
    auto it = blocks_.upper_bound(address(p));
    if (it == blocks_.begin()) return false;
    --it;
    return address(p) + n <= it->first + it->second;
  }

 private:
  static std::uintptr_t address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
  static std::mutex& registry_mutex() {
    static std::mutex m;
    return m;
  }
  static std::set<const tracked_device_space*>& registry() {
    static std::set<const tracked_device_space*> r;
    return r;
  }
  void* note(void* p, std::size_t n) {
    if (p != nullptr) {
      std::lock_guard lock(mutex_);
      blocks_[address(p)] = n;
    }
    return p;
  }
  simulated_device_space inner_;
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, std::size_t> blocks_;  // start -> bytes
};

using tracked_platform = platform<tracked_device_space, host_space, host_copy_engine>;

/** What a device communicator would fault on: a buffer outside device memory. */
struct host_buffer_error : std::logic_error {
  using std::logic_error::logic_error;
};
/** What a host-only communicator (MPI without CUDA support) would fault on: a device buffer. */
struct device_buffer_error : std::logic_error {
  using std::logic_error::logic_error;
};

/** One in-process rank whose void* collectives must name device memory (@p Device, see the file
 *  comment), or must not (host memory only, like an MPI without CUDA support). */
template <bool Device>
class memory_checked_communicator : public blocking_collectives<memory_checked_communicator<Device>> {
 public:
  static constexpr bool takes_device_memory = Device;

  explicit memory_checked_communicator(in_process_communicator& inner) : inner_(inner) {}
  memory_checked_communicator(const memory_checked_communicator&) = delete;
  memory_checked_communicator& operator=(const memory_checked_communicator&) = delete;

  [[nodiscard]] int rank() const { return inner_.rank(); }
  [[nodiscard]] int size() const { return inner_.size(); }
  void barrier() { inner_.barrier(); }
  comm_handle allreduce_async(void* p, std::size_t n, dtype t, reduce_op op) {
    check("allreduce", "inout", p, n * dtype_size(t));
    return inner_.allreduce_async(p, n, t, op);
  }
  comm_handle allreduce_async(std::span<double> d, reduce_op op) { return inner_.allreduce_async(d, op); }
  comm_handle allgather_async(const void* s, void* r, std::size_t n) {
    check("allgather", "send", s, n);
    check("allgather", "recv", r, n * static_cast<std::size_t>(size()));
    return inner_.allgather_async(s, r, n);
  }
  comm_handle reduce_scatter_async(const void* s, void* r, std::size_t n, dtype t, reduce_op op) {
    check("reduce_scatter", "send", s, n * dtype_size(t) * static_cast<std::size_t>(size()));
    check("reduce_scatter", "recv", r, n * dtype_size(t));
    return inner_.reduce_scatter_async(s, r, n, t, op);
  }
  comm_handle reduce_async(const void* s, void* r, std::size_t n, dtype t, reduce_op op, int root) {
    check("reduce", "send", s, n * dtype_size(t));
    if (rank() == root) check("reduce", "recv", r, n * dtype_size(t));
    return inner_.reduce_async(s, r, n, t, op, root);
  }
  comm_handle broadcast_async(void* p, std::size_t n, int root) {
    check("broadcast", "buffer", p, n);
    return inner_.broadcast_async(p, n, root);
  }
  comm_handle ring_shift_async(const void* s, void* r, std::size_t n) {
    check("ring_shift", "send", s, n);
    check("ring_shift", "recv", r, n);
    return inner_.ring_shift_async(s, r, n);
  }
  /** The void* collectives checked so far (a test that checks nothing proves nothing). */
  [[nodiscard]] std::size_t checked() const noexcept { return checked_; }

 private:
  void check(const char* call, const char* which, const void* p, std::size_t n) {
    if constexpr (Device) {
      if (!tracked_device_space::any_holds(p, n))
        throw host_buffer_error(std::string(call) + ": the " + which + " buffer (" + std::to_string(n) +
                                " bytes) is not device memory; a device communicator (NCCL) would fault on it");
    } else {
      if (n != 0 && tracked_device_space::any_overlaps(p, n))
        throw device_buffer_error(
            std::string(call) + ": the " + which + " buffer (" + std::to_string(n) +
            " bytes) is device memory; a host-only communicator (MPI without CUDA) would fault on it");
    }
    ++checked_;
  }
  in_process_communicator& inner_;
  std::size_t checked_ = 0;
};

using device_memory_communicator = memory_checked_communicator<true>;
using host_memory_communicator = memory_checked_communicator<false>;

static_assert(Communicator<device_memory_communicator> && takes_device_memory_v<device_memory_communicator>);
static_assert(!takes_device_memory_v<in_process_communicator> && !takes_device_memory_v<host_memory_communicator>);

}  // namespace chunkstar::testing

template <>
inline constexpr bool chunkstar::can_access_v<chunkstar::host_exec, chunkstar::testing::tracked_device_space> = true;
