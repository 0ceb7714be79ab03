// SPDX-License-Identifier: Apache-2.0
// Trains the residual MLP of residual_mlp.hpp under RTP on N in-process ranks (argument 1, default
// 4), its shards in a chunk runtime on a simulated device that holds half of each rank's model
// data; saves a checkpoint under RTP, then resumes it in one process and trains on the same
// micro-batches. Prints the losses; "own_model: OK" when the resumed run starts from the saved bits.
#include "residual_mlp.hpp"

#include <chunkstar/checkpoint/runtime_checkpoint.hpp>
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/comm/single_process.hpp>
#include <chunkstar/rtp/checkpoint_view.hpp>
#include <chunkstar/rtp/chunk_shard_store.hpp>
#include <chunkstar/runtime/assemblies.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace {

const own_model::config cfg{};
const chunkstar::adam_hyper adamw{.lr = 1e-2f, .beta2 = 0.95f, .weight_decay = 0.1f};
const auto groups = chunkstar::param_groups::with_default_decay(adamw.weight_decay);

/** Micro-batch @p m of step @p s: tokens, and as targets a fixed function of each token. */
void batch(int s, int m, std::vector<int>& tokens, std::vector<int>& targets) {
  tokens.resize(cfg.rows), targets.resize(cfg.rows);
  for (std::size_t i = 0; i < cfg.rows; ++i) {
    tokens[i] =
        static_cast<int>((977u * static_cast<unsigned>(s) + 131u * static_cast<unsigned>(m) + 17u * i) % cfg.vocab);
    targets[i] = (7 * tokens[i] + 3) % static_cast<int>(cfg.vocab);
  }
}

/** Steps [from, to) of @p world micro-batches each on this rank (rank, rank + N, ...). */
template <class Model>
double train(Model& model, int rank, int ranks, int world, int from, int to) {
  double loss = 0;
  std::vector<int> tokens, targets;
  for (int s = from; s < to; ++s) {
    loss = 0;
    for (int m = rank; m < world; m += ranks) {
      batch(s, m, tokens, targets);
      loss += model.forward(tokens.data(), targets.data());
      model.backward(tokens.data(), targets.data());
    }
    const auto r = model.state().step(adamw, groups, world, 1.0f);
    model.state().communicator().allreduce(std::span<double>(&loss, 1), chunkstar::reduce_op::sum);
    loss /= world;
    if (rank == 0) std::printf("step %2d  loss %.4f  grad norm %.4f\n", s, loss, r.grad_norm);
  }
  return loss;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace chunkstar;
  const int n = argc > 1 ? std::atoi(argv[1]) : 4;
  const auto dir = std::filesystem::temp_directory_path() / ("own_model_" + std::to_string(::getpid()));
  std::vector<float> saved, loaded;
  run_ranks(n, [&](in_process_communicator& comm) {
    std::size_t model_bytes = 0;  // this rank's share of the model data, from a host store
    {
      rtp::host_shard_store probe;
      own_model::residual_mlp<in_process_communicator> sizing(comm, probe, cfg);
      model_bytes = probe.bytes();
    }
    simulated_device_space device(
        {.capacity = model_bytes / 2 + (32 << 10)});  // room for half of it beside 32 KiB of buffers
    host_space host;
    host_copy_engine copier;
    single_process_communicator one;
    patrickstar_runtime rt(device, host, copier, one);
    rtp::chunk_shard_store<patrickstar_runtime> store(rt);
    own_model::residual_mlp<in_process_communicator, decltype(store)> model(comm, store, cfg);
    model.init();
    train(model, comm.rank(), n, n, 0, 6);
    save_checkpoint(rtp::checkpoint_save_view(model.state(), comm), dir,
                    {{"steps", std::to_string(model.state().step_count())}});
    if (comm.rank() != 0) return;
    saved.resize(model.state().parts()[0].elems);
    model.state().read(0, chunk_kind::param, saved);
    std::printf(
        "rank 0: %zu bytes of model data, device peak %zu of %zu bytes, %zu bytes moved between device and host\n",
        model_bytes, device.usage().peak, device.capacity(), rt.stats().bytes_moved());
  });
  std::printf("saved under RTP on %d ranks to %s; resuming in one process\n", n, dir.c_str());
  single_process_communicator comm;
  rtp::host_shard_store store;
  own_model::residual_mlp<single_process_communicator> model(comm, store, cfg);
  rtp::checkpoint_load_view view(model.state());
  model.state().restore_step_count(std::stoll(load_checkpoint(view, dir).at("steps")));
  loaded.resize(model.state().parts()[0].elems);
  model.state().read(0, chunk_kind::param, loaded);  // all of E; rank 0's rows come first
  loaded.resize(saved.size());
  train(model, 0, 1, n, 6, 12);
  std::filesystem::remove_all(dir);
  const bool ok = saved == loaded;
  std::printf("own_model: %s\n", ok ? "OK" : "FAILED (the resumed embedding differs from the saved one)");
  return ok ? 0 : 1;
}
