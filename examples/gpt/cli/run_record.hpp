// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief What train_gpt stores in a checkpoint beside the tensors, and what it checks on resume:
 *         the training state (step, optimizer steps, loss scale), parsed with range checks, and
 *         the configuration that decides the trajectory (model shape, data, batch, schedule...),
 *         compared field by field with the options of the resuming run.
 *
 *  Options that do not change the trajectory (budgets, policy, prefetch, chunk size, logging) are
 *  not recorded: a run may resume with any of them changed and continue bit for bit.
 */
#pragma once

#include "train_options.hpp"

#include <chunkstar/checkpoint/detail/xxh64.hpp>
#include <chunkstar/checkpoint/runtime_checkpoint.hpp>
#include <chunkstar/comm/rank_agreement.hpp>
#include <chunkstar/core/error.hpp>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace gpt {

/** @brief One recorded configuration value. */
struct record_field {
  std::string option;  ///< the option that sets it ("lr"), the name --allow-change takes
  std::string key;     ///< its checkpoint_extra key ("train.lr")
  std::string value;
  bool shape = false;  ///< part of the model's shape: a resume can never change it
};

/** @brief The options --allow-change accepts (besides "all"). */
inline constexpr const char* changeable_options[] = {"data",   "seed",         "precision", "batch", "seq",
                                                     "accum",  "steps",        "schedule",  "lr",    "min-lr",
                                                     "warmup", "weight-decay", "clip"};

/** @brief XXH64 of the training data (train and validation bytes), so a resume on other data is noticed. */
inline std::string data_checksum(std::span<const std::uint8_t> train, std::span<const std::uint8_t> val) {
  chunkstar::checkpoint_detail::xxh64 h;
  h.update(std::as_bytes(train));
  h.update(std::as_bytes(val));
  char buf[20];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h.digest()));
  return buf;
}

/** @brief A float as the shortest text that reads back to the same float ("0.003"). */
inline std::string exact(float v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

/** @brief The configuration that decides the trajectory of a run with options @p o. */
inline std::vector<record_field> run_record(const train_options& o, const gpt_config& c, const std::string& data_sum) {
  return {
      {"vocab", "model.vocab", std::to_string(c.vocab), true},
      {"context", "model.context", std::to_string(c.context), true},
      {"layers", "model.layers", std::to_string(c.layers), true},
      {"heads", "model.heads", std::to_string(c.heads), true},
      {"width", "model.width", std::to_string(c.width), true},
      {"data", "train.data", data_sum},
      {"seed", "train.seed", std::to_string(o.seed)},
      {"precision", "train.precision", o.precision},
      {"batch", "train.batch", std::to_string(o.batch)},
      {"seq", "train.seq", std::to_string(o.seq)},
      {"accum", "train.accum", std::to_string(o.accum)},
      {"steps", "train.steps", std::to_string(o.steps)},
      {"schedule", "train.schedule", o.schedule},
      {"lr", "train.lr", exact(o.lr)},
      {"min-lr", "train.min-lr", exact(o.min_lr)},
      {"warmup", "train.warmup", std::to_string(warmup_steps(o))},
      {"weight-decay", "train.weight-decay", exact(o.weight_decay)},
      {"clip", "train.clip", exact(o.clip)},
  };
}

/** @brief What every rank of a run on several ranks must agree on, checked before the first
 *  collective (chunkstar::require_agreement): the recorded configuration (@p record: shape, data,
 *  seed, schedule...) and every option that decides the sequence of collectives or an output the
 *  ranks write together — mode, transport and device kind (@p transport, @p device), steps and where
 *  they stop, evaluation and sampling cadence, the checkpoint to resume (and its step, @p
 *  first_step) and to save, when to sleep (the ranks compare what they hold asleep). A rank's own resources may differ: budgets, policy, prefetch, chunk
 *  size (the runtime agrees on its layout itself), the disk tier, --trace. Pure. */
inline std::vector<chunkstar::config_field> rank_agreement(const std::vector<record_field>& record,
                                                           const train_options& o, std::int64_t first_step,
                                                           const transport_choice& transport,
                                                           const device_choice& device) {
  const char* comm = transport.kind == transport_choice::nccl     ? "nccl"
                     : transport.kind == transport_choice::staged ? "staged"
                                                                  : "mpi";
  std::vector<chunkstar::config_field> f = {
      {"--parallel", o.parallel},
      {"transport (--comm)", comm},
      {"device kind (--device)", device.cuda ? "cuda" : "simulated"},
  };
  for (const auto& r : record) f.push_back({"--" + r.option, r.value});
  const std::vector<chunkstar::config_field> rest = {
      {"--data (source)", o.data.empty() ? "embedded" : o.data},
      {"--stop-after", std::to_string(o.stop_after)},
      {"--val-every", std::to_string(o.val_every)},
      {"--val-batches", std::to_string(o.val_batches)},
      {"--sample", std::to_string(o.sample)},
      {"--memory-saving", o.memory_saving ? "on" : "off"},
      {"--keep-gathered", o.keep_gathered ? "on" : "off"},
      {"--resume", o.resume.empty() ? "(none)" : o.resume + " from step " + std::to_string(first_step)},
      {"--save", o.save.empty() ? "(none)" : o.save},
      {"--save-every", std::to_string(o.save_every)},
      {"--sleep-after", std::to_string(o.sleep_after)},
  };
  f.insert(f.end(), rest.begin(), rest.end());
  return f;
}

/** @brief Throws config_error unless every --allow-change name is known. */
inline void validate_allow_change(const std::vector<std::string>& names) {
  for (const auto& n : names) {
    bool known = n == "all";
    for (const char* c : changeable_options) known = known || n == c;
    if (!known) {
      std::string list;
      for (const char* c : changeable_options) list += std::string(list.empty() ? "" : ", ") + c;
      throw chunkstar::config_error("--allow-change '" + n +
                                    "' is not an option a resume may change; use all or any of: " + list);
    }
  }
}

/** @brief Compares @p now with the configuration stored in the checkpoint @p dir (@p stored) and
 *  throws one config_error naming every difference: a shape difference always, any other unless
 *  @p allowed names its option (or "all"). A value the checkpoint does not record counts as a
 *  difference (a checkpoint of another trainer, or of an older train_gpt). */
inline void check_resume_config(const std::vector<record_field>& now, const chunkstar::checkpoint_extra& stored,
                                const std::vector<std::string>& allowed, const std::string& dir) {
  const auto is_allowed = [&](const std::string& option) {
    for (const auto& a : allowed)
      if (a == "all" || a == option) return true;
    return false;
  };
  std::string shape, other, names;
  for (const auto& f : now) {
    const auto it = stored.find(f.key);
    if (it != stored.end() && it->second == f.value) continue;
    const std::string line =
        "\n  --" + f.option + ": " +
        (it == stored.end() ? std::string("not recorded in the checkpoint") : "checkpoint " + it->second) + ", now " +
        f.value;
    if (f.shape) {
      shape += line;
    } else if (!is_allowed(f.option)) {
      other += line;
      names += (names.empty() ? "" : ",") + f.option;
    }
  }
  if (!shape.empty())
    throw chunkstar::config_error(
        "--resume '" + dir + "': the model's shape differs from the checkpoint's:" + shape +
        "\nresume with the checkpoint's --preset (and --layers, --width, --heads, --context)");
  if (!other.empty())
    throw chunkstar::config_error(
        "--resume '" + dir + "': the run's configuration differs from the checkpoint's:" + other +
        "\nresume with the same options, or let them change with --allow-change " + names + " (or --allow-change all)");
}

/** @brief The training state a checkpoint resumes from. */
struct resume_state {
  std::int64_t step = 0;             ///< the last step the checkpoint completed
  std::int64_t optimizer_steps = 0;  ///< Adam's step count (bias correction): steps not skipped
  std::optional<float> loss_scale;   ///< fp16's dynamic loss scale, when the checkpoint has one
  std::int64_t clean_steps = 0;      ///< steps since the scale last changed
};

namespace detail {
inline const std::string& entry(const chunkstar::checkpoint_extra& e, const std::string& key, const std::string& dir) {
  const auto it = e.find(key);
  if (it == e.end())
    throw chunkstar::config_error("--resume '" + dir + "': the checkpoint has no '" + key +
                                  "' entry; it was not written by train_gpt: resume from a train_gpt checkpoint");
  return it->second;
}
[[noreturn]] inline void bad_entry(const std::string& key, const std::string& value, const std::string& dir,
                                   const std::string& want) {
  throw chunkstar::config_error("--resume '" + dir + "': the checkpoint's '" + key + "' is '" + value + "', not " +
                                want + "; the checkpoint is damaged or not from train_gpt: resume from another one");
}
inline std::int64_t integer_entry(const chunkstar::checkpoint_extra& e, const std::string& key, std::int64_t lo,
                                  std::int64_t hi, const std::string& dir) {
  const std::string& v = entry(e, key, dir);
  std::int64_t x = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (ec != std::errc() || end != v.data() + v.size() || x < lo || x > hi)
    bad_entry(key, v, dir, "an integer from " + std::to_string(lo) + " to " + std::to_string(hi));
  return x;
}
}  // namespace detail

/** @brief Parses the training state of the checkpoint @p dir, with range checks; config_error naming
 *  the entry otherwise. */
inline resume_state parse_resume_state(const chunkstar::checkpoint_extra& e, const std::string& dir) {
  resume_state r;
  r.step = detail::integer_entry(e, "step", 0, option_limits::steps, dir);
  r.optimizer_steps = detail::integer_entry(e, "optimizer_steps", 0, r.step, dir);
  if (const auto it = e.find("loss_scale"); it != e.end()) {
    const std::string& v = it->second;
    float x = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
    if (ec != std::errc() || end != v.data() + v.size() || !std::isfinite(x) || !(x > 0))
      detail::bad_entry("loss_scale", v, dir, "a positive finite number");
    r.loss_scale = x;
    r.clean_steps = detail::integer_entry(e, "clean_steps", 0, option_limits::steps, dir);
  }
  return r;
}

/** @brief Throws config_error unless @p loaded, the entries load_checkpoint read with the tensors
 *  (under its lock, from the files it loaded), are @p checked, those the run's configuration and
 *  state were checked and parsed from before the model was built: another process saved to the
 *  checkpoint in between, and its tensors belong to a state this run did not check. */
inline void require_same_save(const chunkstar::checkpoint_extra& checked, const chunkstar::checkpoint_extra& loaded,
                              const std::string& dir) {
  if (loaded == checked) return;
  const auto step = [](const chunkstar::checkpoint_extra& e) {
    const auto it = e.find("step");
    return it == e.end() ? std::string("?") : it->second;
  };
  throw chunkstar::config_error(
      "--resume '" + dir + "': another process saved to the checkpoint while this run was starting (its step " +
      step(checked) + " when checked, " + step(loaded) +
      " when loaded); nothing was trained: resume again once the other process has finished saving");
}

/** @brief The checkpoint_extra a run saves at @p step: the state and the configuration. */
inline chunkstar::checkpoint_extra save_record(const std::vector<record_field>& config, const train_options& o,
                                               std::int64_t step, std::int64_t optimizer_steps,
                                               std::optional<float> loss_scale, std::int64_t clean_steps) {
  chunkstar::checkpoint_extra e{{"step", std::to_string(step)},
                                {"optimizer_steps", std::to_string(optimizer_steps)},
                                {"preset", o.preset},
                                {"train.data-source", o.data.empty() ? "embedded" : o.data}};
  for (const auto& f : config) e[f.key] = f.value;
  if (loss_scale) {
    e["loss_scale"] = exact(*loss_scale);
    e["clean_steps"] = std::to_string(clean_steps);
  }
  return e;
}

}  // namespace gpt
