// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `gpt::nccl_module`: train_gpt's NCCL communicator, loaded from libgpt_nccl.so (beside the
 *         trainer) when a run asks for it, bootstrapped over the MPI ranks. The module is built
 *         wherever NCCL is; the trainer itself never links NCCL (gpt_nccl_module.cpp says why).
 */
#pragma once

#include <chunkstar/comm/communicator_ref.hpp>
#include <chunkstar/core/error.hpp>

#include <optional>
#include <string>

#include <dlfcn.h>
#include <limits.h>
#include <unistd.h>

extern "C" {
/** Bootstraps NCCL over @p host on CUDA device @p device; `*out` refers to it. Collective over
 *  @p host. Throws chunkstar::communication_error. @return the owner, for gpt_nccl_destroy. */
void* gpt_nccl_create(chunkstar::communicator_ref* host, int device, chunkstar::communicator_ref* out);
void gpt_nccl_destroy(void* comm) noexcept;
}

namespace gpt {

/** @brief The module's file: libgpt_nccl.so in the directory of the running binary. */
inline std::string nccl_module_path() {
  char exe[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  std::string dir = n > 0 ? std::string(exe, static_cast<std::size_t>(n)) : std::string();
  dir = dir.substr(0, dir.find_last_of('/') + 1);
  return dir + "libgpt_nccl.so";
}

/** @brief A loaded NCCL module and the communicator it made (one per rank). Move-only. */
class nccl_module {
 public:
  /** Loads @p path (default: nccl_module_path()) and resolves its entry points, or throws
   *  config_error naming the file and what to do. */
  explicit nccl_module(const std::string& path = nccl_module_path()) : path_(path) {
    handle_ = ::dlopen(path_.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle_ == nullptr)
      throw chunkstar::config_error("--comm nccl: cannot load " + path_ + " (" + std::string(::dlerror()) +
                                    "): build train_gpt where NCCL is installed, or use --comm staged");
    create_ = reinterpret_cast<decltype(create_)>(::dlsym(handle_, "gpt_nccl_create"));
    destroy_ = reinterpret_cast<decltype(destroy_)>(::dlsym(handle_, "gpt_nccl_destroy"));
    if (create_ == nullptr || destroy_ == nullptr) {
      ::dlclose(handle_);
      throw chunkstar::config_error("--comm nccl: " + path_ +
                                    " is not train_gpt's NCCL module (no gpt_nccl_create): rebuild it");
    }
  }
  nccl_module(const nccl_module&) = delete;
  nccl_module& operator=(const nccl_module&) = delete;
  ~nccl_module() {
    if (comm_) destroy_(comm_);
    // The module stays mapped: NCCL's threads and CUDA's callbacks may outlive the communicator.
  }

  /** @brief Bootstraps NCCL over @p host (collective) on CUDA device @p device; once. */
  chunkstar::communicator_ref connect(chunkstar::communicator_ref host, int device) {
    if (!ref_) {
      chunkstar::communicator_ref out = host;
      comm_ = create_(&host, device, &out);
      ref_ = out;
    }
    return *ref_;
  }
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
  void* handle_ = nullptr;
  void* (*create_)(chunkstar::communicator_ref*, int, chunkstar::communicator_ref*) = nullptr;
  void (*destroy_)(void*) noexcept = nullptr;
  void* comm_ = nullptr;
  std::optional<chunkstar::communicator_ref> ref_;
};

}  // namespace gpt
