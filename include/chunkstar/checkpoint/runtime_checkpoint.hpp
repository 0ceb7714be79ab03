// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Checkpoints of a chunk runtime: parameters and optimizer state as per-tensor safetensors
 *         records, independent of chunk size, layout, placement and world size.
 *
 *  A checkpoint is a directory:
 *  - `model.safetensors`: every parameter in its param dtype, named as registered (loadable as
 *    weights by any safetensors reader);
 *  - `optimizer.safetensors`: per parameter "<name>.master" (F32, only for 16-bit params — an fp32
 *    param is its own master), "<name>.exp_avg" and "<name>.exp_avg_sq" (F32), and in its metadata
 *    the trainer's `checkpoint_extra` (step, data position, loss scale, RNG state, config...).
 *  Both carry checksums; the optimizer file also records the model file's checksum, so files from
 *  different saves are never combined. The directory is written as `<dir>.tmp.<pid>.<n>` and swapped
 *  into place atomically, under an advisory lock on `<dir>.lock`. See docs/checkpoints.md.
 */
#pragma once

#include <chunkstar/checkpoint/detail/checkpoint_dir.hpp>
#include <chunkstar/checkpoint/safetensors.hpp>
#include <chunkstar/comm/host_scalars.hpp>
#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/runtime/assemblies.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>
#include <chunkstar/zero/shard_manager.hpp>

#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace chunkstar {

/** @brief What the trainer stores beside the tensors: any string keys (except the reserved
 *  "chunkstar." prefix and "format") to string values. */
using checkpoint_extra = std::map<std::string, std::string>;

/** @brief A runtime whose tensors can be saved and restored. Required expressions (`rt` a runtime,
 *  `c` a const one, `p` a `param_id`):
 *  1. `c.params()` → `tensor_spec`s in registration order (`param_id{i}` is the i-th);
 *  2. `c.options().param_type` (dtype) and `c.has_list(kind)` (bool): which lists exist — param
 *     always, master for 16-bit params with optimizer state, momentum and variance as the
 *     optimizer's state description says;
 *  3. `c.read_tensor(p, kind, std::span<float>)` and `rt.write_tensor(p, kind, std::span<const float>)`
 *     copy one tensor of one list, wherever it lives, widening to / narrowing from fp32.
 *  `chunk_runtime` models it. */
template <class R>
concept CheckpointableRuntime = requires(R& rt, const R& c, std::span<float> out, std::span<const float> in) {
  { c.params() } -> std::convertible_to<std::span<const tensor_spec>>;
  { c.options().param_type } -> std::convertible_to<dtype>;
  { c.has_list(chunk_kind::momentum) } -> std::convertible_to<bool>;
  c.read_tensor(param_id{}, chunk_kind::param, out);
  rt.write_tensor(param_id{}, chunk_kind::param, in);
};

/** @brief What `load_checkpoint` restores. */
struct checkpoint_load_options {
  bool optimizer_state = true;  ///< restore exp_avg/exp_avg_sq (false: weights only, moments untouched)
  bool allow_unused = false;    ///< accept tensors in the checkpoint that no registered parameter takes
};

namespace checkpoint_detail {

inline bool reserved_key(std::string_view k) { return k.starts_with("chunkstar.") || k == "format"; }

template <class R>
tensor_producer list_producer(const R& rt, std::size_t t, chunk_kind k, dtype type) {
  return [&rt, t, k, type](const byte_sink& sink) {
    std::vector<float> v(rt.params()[t].numel());
    rt.read_tensor(param_id{static_cast<std::uint32_t>(t)}, k, v);
    switch (type) {
      case dtype::f32: sink(std::as_bytes(std::span<const float>(v))); break;
      case dtype::f16: {
        std::vector<float16> h(v.size());
        for (std::size_t i = 0; i < v.size(); ++i) h[i] = float16(v[i]);
        sink(std::as_bytes(std::span<const float16>(h)));
        break;
      }
      case dtype::bf16: {
        std::vector<bfloat16> h(v.size());
        for (std::size_t i = 0; i < v.size(); ++i) h[i] = bfloat16(v[i]);
        sink(std::as_bytes(std::span<const bfloat16>(h)));
        break;
      }
    }
  };
}

}  // namespace checkpoint_detail

/** @brief How `save_checkpoint` and `load_checkpoint` wait for another process using the same
 *  checkpoint (the advisory lock on `<dir>.lock`). */
struct checkpoint_lock_options {
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};  ///< then checkpoint_error naming the holder
};

/** @brief Throws `checkpoint_error` now if `save_checkpoint(rt, dir)` would refuse @p dir or could
 *  not write beside it — so a trainer checks its output path before training rather than after.
 *  Creates the missing parent directories (as a save would) and a probe directory that it removes
 *  again; refuses a lock file `<dir>.lock` that is a link or not a regular file; touches nothing else. */
inline void check_checkpoint_target(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  namespace cd = checkpoint_detail;
  std::error_code ec;
  if (dir.empty()) throw checkpoint_error("checkpoint path is empty: name a directory to save to");
  cd::refuse_unless_replaceable(dir);
  const auto parent = cd::parent_of(dir);
  fs::create_directories(parent, ec);
  if (!fs::is_directory(parent, ec))
    throw checkpoint_error("cannot save a checkpoint to '" + dir.string() + "': '" + parent.string() +
                           "' is not a directory and cannot be created; choose another path");
  const auto probe = cd::make_temp_directory(dir);
  fs::remove(probe, ec);
  cd::directory_lock::check_path(dir);
}

namespace checkpoint_detail {

/** A sharded runtime (ZeRO) exposes `shards()`: who owns which chunk. Others hold everything. */
template <class R>
[[nodiscard]] shard_map shards_of(const R& rt) {
  if constexpr (requires { rt.shards(); }) return rt.shards();
  else return {};
}
/** The rank that saves tensor @p t of a sharded runtime: the one the runtime names
 *  (`rt.tensor_owner(t)`, for runtimes that split tensors some other way, such as RTP's), else the
 *  owner of the chunk that holds it (ZeRO). */
template <class R>
[[nodiscard]] int owner_of(const R& rt, std::size_t t) {
  if constexpr (requires { rt.tensor_owner(t); }) return rt.tensor_owner(t);
  else return rt.shards().owner(rt.plan().slots[t].chunk);
}
/** Whether @p rt holds tensor @p t's data (it is in a chunk this rank owns). */
template <class R>
[[nodiscard]] bool holds(const R& rt, std::size_t t) {
  if constexpr (requires {
                  rt.shards();
                  rt.tensor_owner(t);
                })
    return rt.tensor_owner(t) == rt.shards().rank;
  else if constexpr (requires {
                       rt.shards();
                       rt.plan();
                     })
    return rt.shards().owns(rt.plan().slots[t].chunk);
  else return true;
}

/** Writes the tensors of @p rt this rank holds into @p model_path and @p opt_path (see the file comment). */
template <class R>
void write_files(const R& rt, const std::filesystem::path& model_path, const std::filesystem::path& opt_path,
                 const checkpoint_extra& extra, const std::string& save_id) {
  const auto specs = rt.params();
  const dtype param_type = rt.options().param_type;
  const bool master = rt.has_list(chunk_kind::master), mom = rt.has_list(chunk_kind::momentum),
             var = rt.has_list(chunk_kind::variance);
  safetensors_writer model;
  model.set_metadata("format", "pt");
  model.set_metadata(save_id_key, save_id);
  model.set_metadata("chunkstar.param_type", std::string(dtype_name(param_type)));
  for (std::size_t t = 0; t < specs.size(); ++t)
    if (holds(rt, t))
      model.add_producer(specs[t].name, to_safetensors_dtype(param_type), specs[t].shape,
                         list_producer(rt, t, chunk_kind::param, param_type));
  const std::uint64_t model_sum = model.write(model_path);
  safetensors_writer opt;
  for (const auto& [k, v] : extra) opt.set_metadata(k, v);
  opt.set_metadata("format", "pt");
  opt.set_metadata("chunkstar.param_type", std::string(dtype_name(param_type)));
  opt.set_metadata("chunkstar.optimizer_state", mom ? "1" : "0");
  opt.set_metadata("chunkstar.model_checksum", hex64(model_sum));
  opt.set_metadata(save_id_key, save_id);
  for (std::size_t t = 0; t < specs.size(); ++t) {
    if (!holds(rt, t)) continue;
    const auto& s = specs[t];
    if (master)
      opt.add_producer(s.name + ".master", safetensors_dtype::f32, s.shape,
                       list_producer(rt, t, chunk_kind::master, dtype::f32));
    if (mom)
      opt.add_producer(s.name + ".exp_avg", safetensors_dtype::f32, s.shape,
                       list_producer(rt, t, chunk_kind::momentum, dtype::f32));
    if (var)
      opt.add_producer(s.name + ".exp_avg_sq", safetensors_dtype::f32, s.shape,
                       list_producer(rt, t, chunk_kind::variance, dtype::f32));
  }
  opt.write(opt_path);
}

/** The Hugging Face style index of a sharded checkpoint: every parameter's model file. */
template <class R>
void write_index(const R& rt, const std::filesystem::path& path, int world) {
  const auto specs = rt.params();
  const auto escape = [](const std::string& x) {
    std::string out;
    for (char c : x) {
      if (c == '"' || c == '\\') out += '\\';
      out += c;
    }
    return out;
  };
  std::string json = "{\n  \"metadata\": {\"format\": \"chunkstar\", \"world\": \"" + std::to_string(world) +
                     "\"},\n  \"weight_map\": {";
  for (std::size_t t = 0; t < specs.size(); ++t) {
    const int owner = owner_of(rt, t);
    json += std::string(t ? "," : "") + "\n    \"" + escape(specs[t].name) + "\": \"" +
            shard_file_name(checkpoint_model_stem, owner, world) + "\"";
  }
  json += "\n  }\n}\n";
  auto fd = open_file(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, "cannot create");  // in the save's new directory
  write_all(fd.get(), std::as_bytes(std::span(json.data(), json.size())), path);
  fsync_fd(fd.get(), path);
  if (const int err = fd.close()) throw checkpoint_error(errno_message("cannot close", path, err));
}

}  // namespace checkpoint_detail

/** @brief Saves @p rt's parameters and optimizer state, plus @p extra, as the checkpoint directory
 *  @p dir (see the file comment). Holds the exclusive lock on `<dir>.lock` throughout, so
 *  concurrent writers to one directory take turns; writes into a new temporary directory
 *  `<dir>.tmp.<pid>.<n>` (files fsynced), then swaps it into place. An existing @p dir is replaced
 *  only when it is empty or a chunkstar checkpoint (recognised by the metadata chunkstar writes,
 *  and holding nothing else), and only once the new checkpoint is complete, so a failure or a crash
 *  leaves the previous one readable. Nothing is deleted that this save did not create, except the
 *  checkpoint it replaces and temporaries of killed earlier saves.
 *  A sharded runtime (ZeRO, N ranks; or any runtime with `shards()`, `communicator()` and
 *  `tensor_owner(t)`, the rank that saves tensor t, as RTP's checkpoint view) saves collectively —
 *  call it on every rank: each rank writes the tensors it owns as `model-<r>-of-<N>.safetensors`
 *  and `optimizer-<r>-of-<N>.safetensors` (r from 1, both five digits: `model-00001-of-00003`) into rank 0's temporary
 *  directory (a file system every rank sees), rank 0 adds
 *  `model.safetensors.index.json` and swaps the directory in once every rank succeeded.
 *  After a throw (on every rank alike): @p dir is as it was and this save's temporary is gone.
 *  @throws checkpoint_error for a reserved key in @p extra, a @p dir that may not be replaced, a
 *  lock held longer than @p lock.timeout, or any I/O failure (on any rank). */
template <CheckpointableRuntime R>
void save_checkpoint(const R& rt, const std::filesystem::path& dir, const checkpoint_extra& extra = {},
                     checkpoint_lock_options lock = {}) {
  namespace fs = std::filesystem;
  namespace cd = checkpoint_detail;
  for (const auto& [k, v] : extra)
    if (cd::reserved_key(k))
      throw checkpoint_error("checkpoint_extra key '" + k +
                             "' is reserved (\"chunkstar.*\" and \"format\" are written by the library): rename it");
  std::error_code ec;
  if (dir.empty()) throw checkpoint_error("checkpoint path is empty: name a directory to save to");
  const shard_map shards = cd::shards_of(rt);
  std::optional<cd::directory_lock> held;
  fs::path tmp;
  std::string save_id;  // every file of this save carries it; a load refuses files of two saves
  const auto prepare = [&] {
    save_id = cd::new_save_id();
    cd::refuse_unless_replaceable(dir);  // before a lock file is created beside something not ours
    fs::create_directories(cd::parent_of(dir), ec);
    held.emplace(dir, /*exclusive=*/true, lock.timeout);
    cd::refuse_unless_replaceable(dir);  // again under the lock: what the swap will replace
    cd::remove_stale_temps(dir);
    tmp = cd::make_temp_directory(dir);
  };
  if (shards.world == 1) {
    prepare();
    try {
      cd::write_files(rt, tmp / checkpoint_model_file, tmp / checkpoint_optimizer_file, extra, save_id);
      cd::fsync_directory(tmp);
      cd::swap_into_place(tmp, dir);
    } catch (...) {
      fs::remove_all(tmp, ec);
      throw;
    }
    return;
  }
  // Sharded: every rank takes part; each stage ends with every rank knowing whether any failed.
  if constexpr (requires { rt.shards(); }) {
    auto& comm = const_cast<R&>(rt).communicator();
    std::string failure;
    const auto agree = [&](const char* stage) {  // true on every rank when every rank succeeded
      double failed = failure.empty() ? 0.0 : 1.0;
      comm.allreduce(std::span<double>(&failed, 1), reduce_op::max);
      if (failed == 0.0) return;
      if (shards.rank == 0 && !tmp.empty()) fs::remove_all(tmp, ec);
      throw checkpoint_error(failure.empty()
                                 ? "saving checkpoint '" + dir.string() + "' failed on another rank while " + stage +
                                       " (that rank reports why); the previous checkpoint is intact"
                                 : failure);
    };
    if (shards.rank == 0) {
      try {
        prepare();
      } catch (const std::exception& e) {
        failure = e.what();
      }
    }
    agree("preparing the directory");
    tmp = broadcast_string(comm, tmp.string(), 0);  // host scalars only: a device communicator may not read host memory
    save_id = broadcast_string(comm, save_id, 0);
    try {
      cd::write_files(rt, tmp / cd::shard_file_name(cd::checkpoint_model_stem, shards.rank, shards.world),
                      tmp / cd::shard_file_name(cd::checkpoint_optimizer_stem, shards.rank, shards.world), extra,
                      save_id);
    } catch (const std::exception& e) {
      failure = e.what();
    }
    agree("writing its shard");
    if (shards.rank == 0) {
      try {
        cd::write_index(rt, tmp / checkpoint_index_file, shards.world);
        cd::fsync_directory(tmp);
        cd::swap_into_place(tmp, dir);
        tmp.clear();
      } catch (const std::exception& e) {
        failure = e.what();
      }
    }
    agree("swapping the directory into place");
  }
}

/** @brief Restores @p rt from the checkpoint directory @p dir and returns the trainer's extra
 *  entries. Call after `finalize()`. Every registered parameter must be present with its shape
 *  (the chunk size, layout and world size may differ from the saving run). Everything is validated
 *  — checksums, names, shapes, dtypes — before any tensor of @p rt is written.
 *  Parameters take the model file's values; a 16-bit runtime's master takes "<name>.master" when
 *  present, else the (widened) model values; an fp32 runtime loading a 16-bit checkpoint takes the
 *  master, so no precision is lost.
 *  @throws checkpoint_error naming the directory and every missing or mismatched tensor. */
template <CheckpointableRuntime R>
checkpoint_extra load_checkpoint(R& rt, const std::filesystem::path& dir, checkpoint_load_options options = {},
                                 checkpoint_lock_options lock = {}) {
  namespace fs = std::filesystem;
  namespace cd = checkpoint_detail;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    std::string what = "does not exist";
    std::string hint = "check the path";
    if (fs::exists(dir, ec)) {
      what = "is not a directory";
      hint = "pass the directory save_checkpoint wrote (it holds " + std::string(checkpoint_model_file) + " and " +
             std::string(checkpoint_optimizer_file) + ")";
    } else if (const auto left = cd::interrupted_swap_leftovers(dir); !left.empty()) {
      hint = "a save was interrupted while swapping directories; the complete checkpoint is in one of";
      for (const auto& p : left) hint += " '" + p.string() + "'";
      hint += ": rename it to '" + dir.string() + "'";
    }
    throw checkpoint_error("checkpoint directory '" + dir.string() + "' " + what + ": " + hint);
  }
  // A shared lock: a concurrent save waits, so all files come from one save. Read-only media
  // (no lock file possible) are read without it.
  const cd::directory_lock held(dir, /*exclusive=*/false, lock.timeout, /*optional_if_unwritable=*/true);
  const auto [model, opt] = cd::open_checkpoint_files(dir);
  const auto meta = [&](const cd::file_set& f, const std::string& k) -> std::string {
    const auto it = f.metadata().find(k);
    if (it == f.metadata().end())
      throw checkpoint_error("checkpoint file '" + f.first_path().string() + "' has no \"" + k +
                             "\" metadata: it was not written by save_checkpoint");
    return it->second;
  };
  const bool file_state = meta(opt, "chunkstar.optimizer_state") == "1";
  const bool rt_master = rt.has_list(chunk_kind::master), rt_var = rt.has_list(chunk_kind::variance);
  const bool want_moments = rt.has_list(chunk_kind::momentum) && options.optimizer_state;
  if (want_moments && !file_state)
    throw checkpoint_error("checkpoint '" + dir.string() +
                           "' holds no optimizer state: load it with checkpoint_load_options{.optimizer_state = false} "
                           "to take the weights only (the optimizer then starts from zero moments)");

  // Validate everything first, so a mismatch leaves the runtime untouched.
  const auto specs = rt.params();
  std::vector<std::string> problems;
  std::map<std::string, bool> used_model, used_opt;
  for (const auto& n : model.names()) used_model[n] = false;
  for (const auto& n : opt.names()) used_opt[n] = false;
  auto check = [&](const cd::file_set& f, std::map<std::string, bool>& used, const std::string& name,
                   const tensor_spec& s, bool required, bool f32_only) -> bool {
    const auto* t = f.find(name);
    if (!t) {
      if (required) problems.push_back("'" + name + "' missing from " + f.description());
      return false;
    }
    used[name] = true;
    if (t->shape != s.shape)
      problems.push_back("'" + name + "' has shape " + t->shape_string() + " in the checkpoint, " + s.shape_string() +
                         " registered");
    else if (f32_only ? t->type != safetensors_dtype::f32 : !is_floating(t->type))
      problems.push_back("'" + name + "' is " + std::string(safetensors_dtype_name(t->type)) +
                         (f32_only ? ", optimizer state must be F32" : ", not a floating-point type"));
    return true;
  };
  std::vector<bool> has_master(specs.size(), false);
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const auto& s = specs[i];
    check(model, used_model, s.name, s, true, false);
    has_master[i] = check(opt, used_opt, s.name + ".master", s, false, true);
    if (file_state) {
      check(opt, used_opt, s.name + ".exp_avg", s, want_moments, true);
      check(opt, used_opt, s.name + ".exp_avg_sq", s, want_moments && rt_var, true);
    }
  }
  if (!options.allow_unused) {
    std::vector<std::string> unused;
    for (const auto& [n, u] : used_model)
      if (!u) unused.push_back(n);
    for (const auto& [n, u] : used_opt)
      if (!u) unused.push_back(n);
    if (!unused.empty()) {
      std::string list;
      for (std::size_t i = 0; i < unused.size() && i < 10; ++i) list += (i ? ", '" : "'") + unused[i] + "'";
      if (unused.size() > 10) list += " and " + std::to_string(unused.size() - 10) + " more";
      problems.push_back(std::to_string(unused.size()) + " tensor(s) no registered parameter takes: " + list);
    }
  }
  if (!problems.empty()) {
    std::string msg = "checkpoint '" + dir.string() + "' does not match the runtime's " + std::to_string(specs.size()) +
                      " parameters:";
    for (std::size_t i = 0; i < problems.size() && i < 20; ++i) msg += "\n  " + problems[i];
    if (problems.size() > 20) msg += "\n  ... and " + std::to_string(problems.size() - 20) + " more";
    msg += "\nregister the same parameters (names and shapes) as the run that saved it";
    if (!options.allow_unused) msg += ", or pass checkpoint_load_options{.allow_unused = true} to skip extra tensors";
    throw checkpoint_error(msg);
  }

  std::vector<float> v, full;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    if (!cd::holds(rt, i)) continue;  // ZeRO: another rank owns it (every rank validated everything above)
    const auto& s = specs[i];
    const param_id id{static_cast<std::uint32_t>(i)};
    v.resize(s.numel());
    model.read_floats(s.name, v);
    if (has_master[i]) {
      full.resize(s.numel());
      opt.read_floats(s.name + ".master", full);
    } else {
      full = v;
    }
    rt.write_tensor(id, chunk_kind::param, rt_master ? std::span<const float>(v) : std::span<const float>(full));
    if (rt_master) rt.write_tensor(id, chunk_kind::master, full);
    if (want_moments) {
      opt.read_floats(s.name + ".exp_avg", v);
      rt.write_tensor(id, chunk_kind::momentum, v);
      if (rt_var) {
        opt.read_floats(s.name + ".exp_avg_sq", v);
        rt.write_tensor(id, chunk_kind::variance, v);
      }
    }
  }
  checkpoint_extra extra;
  for (const auto& [k, val] : opt.metadata())
    if (!cd::reserved_key(k)) extra.emplace(k, val);
  return extra;
}

/** @brief The trainer's entries (`checkpoint_extra`) of the checkpoint @p dir, verified (checksum)
 *  but without touching any runtime: what a trainer compares with its options before it builds one.
 *  @throws checkpoint_error as load_checkpoint does for a missing, foreign or corrupt checkpoint. */
inline checkpoint_extra read_checkpoint_extra(const std::filesystem::path& dir, checkpoint_lock_options lock = {}) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw checkpoint_error("checkpoint directory '" + dir.string() + "' " +
                           (fs::exists(dir, ec) ? "is not a directory" : "does not exist") +
                           ": pass the directory save_checkpoint wrote");
  const checkpoint_detail::directory_lock held(dir, false, lock.timeout, true);
  // Every file verified and of one save (a shard of another save is refused); the entries, which
  // every optimizer file of a save carries alike, from the first.
  const auto files = checkpoint_detail::open_checkpoint_files(dir);
  const safetensors_file& opt = files.second.files().front();
  checkpoint_extra extra;
  for (const auto& [k, val] : opt.metadata())
    if (!checkpoint_detail::reserved_key(k)) extra.emplace(k, val);
  return extra;
}

/** @brief The default runtime models the concept. */
static_assert(CheckpointableRuntime<patrickstar_runtime>);

}  // namespace chunkstar
