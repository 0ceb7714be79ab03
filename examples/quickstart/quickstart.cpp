// quickstart: chunkstar's foundations on one page, no GPU needed.
//
// 1. Register the parameters of a GPT-2-shaped model (byte-level vocabulary).
// 2. Lay them out in chunks with the searched layout (the chunk size that wastes least).
// 3. Allocate the parallel chunk lists (fp16 params and grads, fp32 master, Adam m and v) in host memory.
// 4. Run a forward pass (chunks in order, read only) and a backward pass (reverse order, writing)
//    over the param chunks on a simulated device that holds only part of them, moving chunks with
//    the copy engine over a modelled link and evicting the least recently used chunk when full.
// 5. Write everything back and check every parameter on the host against the value expected.
//
// usage: quickstart [--layers N] [--width D] [--device-fraction F] [--bandwidth-gbs B] [--quiet]
#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/core/units.hpp>
#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/layout/searched_chunk_layout.hpp>
#include <chunkstar/memory/host_copy_engine.hpp>
#include <chunkstar/memory/host_space.hpp>
#include <chunkstar/memory/simulated_device_space.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

using namespace chunkstar;

namespace {

struct args {
  int layers = 12;
  int width = 256;
  int context = 1024;
  int vocab = 256;               // byte-level tokens
  double device_fraction = 0.4;  // of the param list
  double bandwidth_gbs = 4.0;    // modelled host <-> device link, GB/s
  bool quiet = false;
};

args parse(int argc, char** argv) {
  args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "quickstart: %s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--layers") a.layers = std::atoi(next());
    else if (k == "--width") a.width = std::atoi(next());
    else if (k == "--device-fraction") a.device_fraction = std::atof(next());
    else if (k == "--bandwidth-gbs") a.bandwidth_gbs = std::atof(next());
    else if (k == "--quiet") a.quiet = true;
    else {
      std::fprintf(stderr,
                   "usage: quickstart [--layers N] [--width D] [--device-fraction F] [--bandwidth-gbs B] [--quiet]\n");
      std::exit(k == "--help" ? 0 : 2);
    }
  }
  if (a.layers < 1 || a.width < 1 || a.device_fraction <= 0 || a.device_fraction > 1 || a.bandwidth_gbs <= 0) {
    std::fprintf(stderr, "quickstart: need layers >= 1, width >= 1, 0 < device-fraction <= 1, bandwidth > 0\n");
    std::exit(2);
  }
  return a;
}

// GPT-2's parameters in the order a forward pass uses them.
std::vector<tensor_spec> gpt_parameters(const args& a) {
  const std::int64_t d = a.width;
  std::vector<tensor_spec> p;
  auto add = [&](std::string name, std::vector<std::int64_t> shape, tensor_role role) {
    p.push_back({std::move(name), std::move(shape), dtype::f16, role});
  };
  add("wte", {a.vocab, d}, tensor_role::embedding);
  add("wpe", {a.context, d}, tensor_role::embedding);
  for (int l = 0; l < a.layers; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    add(h + "ln_1.weight", {d}, tensor_role::norm);
    add(h + "ln_1.bias", {d}, tensor_role::norm);
    add(h + "attn.c_attn.weight", {d, 3 * d}, tensor_role::weight);
    add(h + "attn.c_attn.bias", {3 * d}, tensor_role::bias);
    add(h + "attn.c_proj.weight", {d, d}, tensor_role::weight);
    add(h + "attn.c_proj.bias", {d}, tensor_role::bias);
    add(h + "ln_2.weight", {d}, tensor_role::norm);
    add(h + "ln_2.bias", {d}, tensor_role::norm);
    add(h + "mlp.c_fc.weight", {d, 4 * d}, tensor_role::weight);
    add(h + "mlp.c_fc.bias", {4 * d}, tensor_role::bias);
    add(h + "mlp.c_proj.weight", {4 * d, d}, tensor_role::weight);
    add(h + "mlp.c_proj.bias", {d}, tensor_role::bias);
  }
  add("ln_f.weight", {d}, tensor_role::norm);
  add("ln_f.bias", {d}, tensor_role::norm);
  return p;
}

// Initial value of element i of any tensor: small integers, so halving them in fp16 is exact and
// the final check needs no tolerance.
float initial_value(std::size_t i) { return static_cast<float>(i % 64); }

}  // namespace

int main(int argc, char** argv) {
  const args a = parse(argc, argv);
  const auto specs = gpt_parameters(a);
  std::size_t params = 0;
  for (const auto& s : specs) params += s.numel();
  std::printf("model: GPT-2 shape, %d layers, width %d, %zu tensors, %.2f M parameters\n", a.layers, a.width,
              specs.size(), static_cast<double>(params) / 1e6);

  // --- 2. layout ---------------------------------------------------------------------------
  // Left unbounded, the least-waste chunk would hold the whole model; a chunk is the unit of
  // movement, so the search is bounded to between 1x and 4x the largest tensor.
  std::size_t largest = 0;
  for (const auto& s : specs) largest = s.numel() > largest ? s.numel() : largest;
  const std::size_t align_elems = 32;
  const std::size_t min_chunk = (largest + align_elems - 1) / align_elems * align_elems;
  const searched_chunk_layout layout({.min_chunk_elems = min_chunk,
                                      .max_chunk_elems = 4 * min_chunk,
                                      .step_elems = align_elems * 1024,
                                      .align_elems = align_elems});
  const auto [plan, report] = layout.search(specs);
  std::printf("layout: %s, %zu chunk sizes tried, chunk %zu elements, %zu chunks, waste %.2f%%\n",
              std::string(layout.name()).c_str(), report.candidates_tried, plan.chunk_elems, plan.num_chunks,
              100.0 * plan.waste_fraction());

  // --- 3. the parallel chunk lists in host memory --------------------------------------------
  const auto lists = make_chunk_lists(plan, {.param_type = dtype::f16});
  host_space host;
  constexpr std::size_t align = 64;
  std::vector<std::vector<void*>> host_chunks(lists.size());
  for (std::size_t l = 0; l < lists.size(); ++l) {
    for (std::size_t c = 0; c < lists[l].num_chunks; ++c) {
      void* p = host.allocate(lists[l].chunk_bytes, align);
      std::memset(p, 0, lists[l].chunk_bytes);
      host_chunks[l].push_back(p);
    }
    std::printf("list %-8s %-4s %zu x %s\n", std::string(chunk_kind_name(lists[l].kind)).c_str(),
                std::string(dtype_name(lists[l].type)).c_str(), lists[l].num_chunks,
                format_bytes(lists[l].chunk_bytes).c_str());
  }
  std::printf("host: %s allocated\n", format_bytes(host.used()).c_str());

  // Initial parameters, written where the plan puts each tensor.
  const auto& param_list = lists[0];
  auto param_at = [&](std::size_t chunk, void* base = nullptr) {
    return static_cast<float16*>(base ? base : host_chunks[0][chunk]);
  };
  for (std::size_t t = 0; t < specs.size(); ++t) {
    const auto& slot = plan.slots[t];
    float16* p = param_at(slot.chunk) + slot.offset;
    for (std::size_t i = 0; i < slot.numel; ++i) p[i] = from_float<float16>(initial_value(i));
  }

  // --- 4. forward and backward over a simulated device that cannot hold every chunk -------------
  const copy_model link{.bandwidth_bytes_per_s = a.bandwidth_gbs * 1e9, .latency_s = 10e-6};
  const std::size_t chunk_bytes = param_list.chunk_bytes;
  const auto fit = static_cast<std::size_t>(a.device_fraction * static_cast<double>(plan.num_chunks));
  const std::size_t device_chunks = fit < 2 ? 2 : fit;  // a working set needs at least two chunks
  simulated_device_space device({.capacity = device_chunks * chunk_bytes, .link = link});
  host_copy_engine engine(link);
  std::printf("device: %s, capacity %s (%zu of %zu param chunks), link %.1f GB/s\n", device.name().c_str(),
              format_bytes(device.capacity()).c_str(), device_chunks, plan.num_chunks, a.bandwidth_gbs);

  struct resident {
    void* block = nullptr;
    bool dirty = false;
  };
  std::vector<resident> on_device(plan.num_chunks);
  std::deque<std::size_t> lru;  // resident chunks, least recently used first
  std::size_t moves = 0, evictions = 0;

  auto log = [&](const char* fmt, auto... xs) {
    if (!a.quiet) std::printf(fmt, xs...);
  };
  auto evict = [&](std::size_t c, const char* why) {
    resident& r = on_device[c];
    if (r.dirty) {
      engine.copy(host_chunks[0][c], r.block, chunk_bytes, copy_direction::to_host);
      log("  %-8s chunk %3zu device -> host  (%s)\n", why, c, format_bytes(chunk_bytes).c_str());
      ++moves;
    } else {
      log("  %-8s chunk %3zu dropped (clean: the host copy is current)\n", why, c);
    }
    device.deallocate(r.block, chunk_bytes, align);
    r = {};
    std::erase(lru, c);
    ++evictions;
  };
  auto fetch = [&](std::size_t c) -> float16* {
    resident& r = on_device[c];
    if (r.block == nullptr) {
      void* b = device.try_allocate(chunk_bytes, align);
      while (b == nullptr) {  // device full: make room by evicting the least recently used chunk
        evict(lru.front(), "evict");
        b = device.try_allocate(chunk_bytes, align);
      }
      engine.copy(b, host_chunks[0][c], chunk_bytes, copy_direction::to_device);
      log("  fetch    chunk %3zu host -> device  (%s, device %s used)\n", c, format_bytes(chunk_bytes).c_str(),
          format_bytes(device.used()).c_str());
      ++moves;
      r.block = b;
    } else {
      std::erase(lru, c);
    }
    lru.push_back(c);
    return param_at(c, r.block);
  };

  const auto start = std::chrono::steady_clock::now();
  double checksum = 0;  // what the "forward" reads, so the reads are real
  std::printf("forward:\n");
  for (std::size_t c = 0; c < plan.num_chunks; ++c) {
    const float16* p = fetch(c);
    for (std::size_t t : plan.chunk_tensors[c]) {
      const auto& slot = plan.slots[t];
      for (std::size_t i = 0; i < slot.numel; ++i) checksum += to_float(p[slot.offset + i]);
    }
  }
  std::printf("backward:\n");
  for (std::size_t c = plan.num_chunks; c-- > 0;) {
    float16* p = fetch(c);
    for (std::size_t t : plan.chunk_tensors[c]) {  // stands in for an update: halve each parameter
      const auto& slot = plan.slots[t];
      for (std::size_t i = 0; i < slot.numel; ++i) p[slot.offset + i] = from_float<float16>(0.5f * to_float(p[slot.offset + i]));
    }
    on_device[c].dirty = true;
  }
  std::printf("flush:\n");
  while (!lru.empty()) evict(lru.front(), "flush");
  engine.synchronize();
  const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // --- 5. check every parameter on the host ---------------------------------------------------
  double expected_checksum = 0;
  std::size_t wrong = 0;
  for (std::size_t t = 0; t < specs.size(); ++t) {
    const auto& slot = plan.slots[t];
    const float16* p = param_at(slot.chunk) + slot.offset;
    for (std::size_t i = 0; i < slot.numel; ++i) {
      expected_checksum += initial_value(i);
      if (to_float(p[i]) != 0.5f * initial_value(i)) ++wrong;
    }
  }

  const auto stats = engine.stats();
  for (auto d : {copy_direction::to_device, copy_direction::to_host}) {
    std::printf("moved %-9s %4llu copies, %10s, link busy %.2f ms\n", std::string(to_string(d)).c_str(),
                static_cast<unsigned long long>(stats[d].copies), format_bytes(stats[d].bytes).c_str(),
                1e3 * stats[d].busy_s);
  }
  std::printf("total: %zu moves, %zu evictions, %s moved in %.2f ms; device peak %s of %s\n", moves, evictions,
              format_bytes(stats.total_bytes()).c_str(), 1e3 * wall_s, format_bytes(device.peak()).c_str(),
              format_bytes(device.capacity()).c_str());

  const bool ok = wrong == 0 && checksum == expected_checksum && device.peak() <= device.capacity() &&
                  stats[copy_direction::to_device].bytes + stats[copy_direction::to_host].bytes == moves * chunk_bytes;
  for (std::size_t l = 0; l < lists.size(); ++l)
    for (void* p : host_chunks[l]) host.deallocate(p, lists[l].chunk_bytes, align);
  if (!ok) {
    std::printf("quickstart: FAILED (%zu parameters wrong, checksum %.0f vs %.0f)\n", wrong, checksum,
                expected_checksum);
    return 1;
  }
  std::printf("quickstart: OK (all %zu parameters on the host hold their updated values)\n", params);
  return 0;
}
