// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Checks train_gpt runs before any work starts, so that a run that cannot finish fails at
 *         once with a clear error instead of after hours of training (or never): output files
 *         that cannot be written, and memory the process could never get — physical memory, and
 *         the address-space limit (`ulimit -v`), under which BLAS libraries loop for ever in
 *         their buffer allocation instead of failing.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/memory_report.hpp>
#include <chunkstar/core/units.hpp>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

namespace gpt {

/** @brief Throws config_error naming @p option unless @p path can be written at the end of the run:
 *  an existing regular file that opens for writing (it is not truncated here), or a new file that
 *  can be created in its directory (created and removed again). */
inline void probe_output_file(const std::string& option, const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode))
      throw chunkstar::config_error(option + " '" + path + "' exists and is not a regular file: choose a file path");
    const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
      throw chunkstar::config_error(option + " '" + path + "' cannot be written: " + std::strerror(errno) +
                                    "; choose another path");
    ::close(fd);
    return;
  }
  const std::string probe = path + ".probe." + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0)
    throw chunkstar::config_error(option + " '" + path + "' cannot be created: " + std::strerror(errno) +
                                  "; check that its directory exists and is writable");
  ::close(fd);
  ::unlink(probe.c_str());
}

/** @brief What a run will need, for the memory check. */
struct memory_need {
  std::size_t model_data = 0;   ///< all chunk lists
  std::size_t activations = 0;  ///< non-model memory of one micro-batch
  std::size_t device = 0;       ///< the (simulated) device's capacity, host memory on this backend
};

/** @brief The host memory a run needs: on the simulated device its capacity is host memory too
 *  (activations and part of the model data); on a real device (@p device_is_host_memory false) the
 *  activations live there and only the model data can come to the host (all of it at worst). */
inline memory_need host_memory_need(std::size_t model_data, std::size_t activations, std::size_t device_capacity,
                                    bool device_is_host_memory) {
  if (device_is_host_memory) return {.model_data = model_data, .activations = activations, .device = device_capacity};
  return {.model_data = model_data};
}

/** @brief Address space the run grows by beyond its data once it computes: per core a BLAS buffer
 *  (OpenBLAS: 128 MiB), a malloc arena (64 MiB) and a thread stack (8 MiB); the copy engine's
 *  threads' stacks; and a margin. Measured on the trainer: 370 MiB of growth for `tiny` on 2 cores,
 *  against 560 MiB estimated here. */
inline std::size_t runtime_overhead_bytes() {
  constexpr std::size_t MiB = std::size_t{1} << 20;
  const std::size_t cores = std::max(1u, std::thread::hardware_concurrency());
  return cores * 200 * MiB + 4 * 8 * MiB + 128 * MiB;
}

/** @brief The address space this process maps now (VmSize, /proc/self/statm); 0 when unknown. */
inline std::size_t mapped_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long long pages = 0;
  const bool ok = std::fscanf(f, "%llu", &pages) == 1;
  std::fclose(f);
  return ok ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)) : 0;
}

/** @brief For an out-of-memory message: when this process runs under an address-space limit, a
 *  sentence saying so (host allocations fail at that limit, whatever the budgets); else "". */
inline std::string address_space_note() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_AS, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return {};
  const auto limit = static_cast<std::size_t>(lim.rlim_cur);
  return " (this process runs under an address-space limit, ulimit -v " + chunkstar::format_bytes(limit) +
         ", of which " + chunkstar::format_bytes(mapped_bytes()) +
         " is mapped now: host allocations fail there whatever the budgets; raise the "
         "limit or train a smaller model)";
}

/** @brief Throws out_of_memory_error (with a report) when @p need can never be met: more than the
 *  machine's memory and swap, or more address space than `ulimit -v` leaves this process (probed by
 *  reserving it, which costs no memory). */
inline void check_memory(const memory_need& need) {
  // The device is simulated in host memory: its capacity holds the activations and part of the
  // model data, the host the rest.
  const double data = static_cast<double>(std::max(need.model_data + need.activations, need.device));
  const std::size_t overhead = runtime_overhead_bytes();
  const double page = static_cast<double>(::sysconf(_SC_PAGESIZE));
  const double physical = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * page;
  const auto report = [&](std::size_t as_limit) {
    chunkstar::memory_report r;
    r.spaces.push_back({"model data (all chunk lists)", SIZE_MAX, need.model_data, need.model_data, 0});
    r.spaces.push_back({"activations (one micro-batch)", SIZE_MAX, need.activations, need.activations, 0});
    r.spaces.push_back({"BLAS buffers, thread stacks, code (estimate)", SIZE_MAX, overhead, overhead, 0});
    r.spaces.push_back({"physical memory", static_cast<std::size_t>(physical), 0, 0, 0});
    if (as_limit != SIZE_MAX) r.spaces.push_back({"address-space limit (ulimit -v)", as_limit, 0, 0, 0});
    return r;
  };
  if (data > 0.95 * physical) {
    const std::size_t bytes = data > 1.8e19 ? SIZE_MAX : static_cast<std::size_t>(data);
    throw chunkstar::out_of_memory_error(
        "this run needs " + chunkstar::format_bytes(bytes) +
            " of host memory for model data and activations, more than this machine's " +
            chunkstar::format_bytes(static_cast<std::size_t>(physical)) +
            ": train a smaller model (--preset, --layers, --width) or a smaller batch",
        bytes, report(SIZE_MAX));
  }
  rlimit lim{};
  if (::getrlimit(RLIMIT_AS, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return;
  const std::size_t want = static_cast<std::size_t>(data) + overhead;
  void* p = ::mmap(nullptr, want, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p != MAP_FAILED) {
    ::munmap(p, want);
    return;
  }
  const auto as_limit = static_cast<std::size_t>(lim.rlim_cur);
  const std::size_t mapped = mapped_bytes();
  const std::size_t left = as_limit > mapped ? as_limit - mapped : 0;
  throw chunkstar::out_of_memory_error(
      "the address-space limit of this process (ulimit -v: " + chunkstar::format_bytes(as_limit) + "), less the " +
          chunkstar::format_bytes(mapped) + " it maps already (code, libraries, the data read), leaves " +
          chunkstar::format_bytes(left) + ", less than the " + chunkstar::format_bytes(want) +
          " this run needs (model data, activations, BLAS buffers and thread stacks): raise the limit (ulimit -v) to "
          "at least " +
          chunkstar::format_bytes(mapped + want + (std::size_t{64} << 20)) + ", or train a smaller model",
      want, report(as_limit));
}

}  // namespace gpt
