#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""torch_gpt: a plain PyTorch GPT of train_gpt's shape and math, as a baseline for chunkstar.

The model is examples/gpt's: byte-level vocabulary (256), learned positions, pre-LayerNorm blocks
(eps 1e-5) of causal self-attention and a 4x MLP with tanh-GELU, a final LayerNorm, and the LM head
tied to the token embedding. Initialisation is GPT-2's, as chunkstar's: weights N(0, 0.02), the two
projections into the residual stream scaled by 1/sqrt(2L), biases 0, LayerNorm gains 1. AdamW with
betas (0.9, 0.95), eps 1e-8, weight decay on the matrices only (embeddings and linear weights, as
chunkstar's param_groups::with_default_decay), a constant learning rate (no schedule: this measures
speed, not a training recipe).

Data: random byte tokens drawn from a torch.Generator seeded with --seed, the same batches in every
mode, so the modes must report the same losses up to rounding. On random tokens nothing can be
learnt beyond the unigram distribution, so the loss starts near and stays near ln 256 = 5.55;
--data FILE trains on the bytes of a file instead (e.g. examples/gpt/data/corpus.txt), where it falls.

Modes, run one after the other on the same model, seed and batches:
  device         everything on --device: torch.optim.AdamW, fused where this torch offers it on
                 the device, else foreach.
  cpu_optimizer  the optimizer step on the CPU, the model computing on the GPU: DeepSpeedCPUAdam
                 (fp32 master weights and the Adam state in pinned host memory, gradients copied
                 down, parameters copied back up each step: ZeRO-Offload's pattern) when deepspeed
                 is importable, else FSDP with CPUOffload(offload_params=True) on a one-rank
                 process group (torch.optim.AdamW then steps the CPU-resident parameters), else
                 reported as skipped with the reason. Needs --device cuda.

Per mode: tokens/s (median over the steps after 2 warm-up steps; a step = forward, backward,
optimizer step, synchronised), peak GPU memory (torch.cuda.max_memory_allocated), first and last
loss. --precision bf16/fp16 runs the forward and backward under torch.autocast (fp16 with a
GradScaler); the weights and the optimizer stay fp32, and fp32 matmuls keep PyTorch's default
precision (no TF32), as chunkstar's fp32 kernels.

Exit: 0 measured (a mode may be skipped), 77 --device cuda without a usable GPU, 1 a mode failed,
2 bad arguments. Needs no network.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

PRESETS = {  # examples/gpt/model/model_config.hpp
    "tiny": dict(context=128, layers=4, heads=4, width=64),
    "mini": dict(context=128, layers=6, heads=8, width=256),
    "small": dict(context=256, layers=6, heads=6, width=384),
    "gpt2": dict(context=1024, layers=12, heads=12, width=768),
    "350m": dict(context=1024, layers=24, heads=16, width=1024),
    "760m": dict(context=1024, layers=36, heads=20, width=1280),
    "1.3b": dict(context=1024, layers=24, heads=16, width=2048),
}
VOCAB = 256
WARMUP_STEPS = 2
MODES = ("device", "cpu_optimizer")


class Skip(Exception):
    """A mode that cannot run here; the message says why."""


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="mini", choices=list(PRESETS), help="model shape (default mini)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4, as train_gpt)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence, <= the context (default 64, as train_gpt)")
    p.add_argument("--steps", type=int, default=20, help=f"steps per mode, > {WARMUP_STEPS} (default 20)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--lr", type=float, default=3e-3, help="constant learning rate (default 3e-3, train_gpt's peak)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--data", help="train on this file's bytes instead of random tokens")
    p.add_argument("--json", help="write the configuration and every mode's results here")
    a = p.parse_args(argv)
    ctx = PRESETS[a.preset]["context"]
    if a.batch < 1:
        p.error("--batch must be >= 1")
    if not 1 <= a.seq <= ctx:
        p.error(f"--seq must be in [1, {ctx}] (the {a.preset} preset's context)")
    if a.steps <= WARMUP_STEPS:
        p.error(f"--steps must be > {WARMUP_STEPS}: the first {WARMUP_STEPS} are warm-up and not timed")
    a.modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in a.modes if m not in MODES]
    if bad or not a.modes:
        p.error(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    return a


def build_model(torch, cfg):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self, C, NH):
            super().__init__()
            self.nh = NH
            self.ln1 = nn.LayerNorm(C, eps=1e-5)
            self.qkv = nn.Linear(C, 3 * C)
            self.proj = nn.Linear(C, C)
            self.ln2 = nn.LayerNorm(C, eps=1e-5)
            self.fc = nn.Linear(C, 4 * C)
            self.fcproj = nn.Linear(4 * C, C)

        def forward(self, x):
            B, T, C = x.shape
            # qkv rows are [q | k | v], each split into heads of C/NH channels (kernels_cpu.hpp's layout)
            q, k, v = (t.view(B, T, self.nh, C // self.nh).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(C, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # softmax(q k^T / sqrt(hs)) v, causal
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
            return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self, c):
            super().__init__()
            C, L = c["width"], c["layers"]
            self.wte = nn.Embedding(VOCAB, C)
            self.wpe = nn.Embedding(c["context"], C)
            self.blocks = nn.ModuleList(Block(C, c["heads"]) for _ in range(L))
            self.lnf = nn.LayerNorm(C, eps=1e-5)
            for name, prm in self.named_parameters():
                if name.endswith("bias"):
                    nn.init.zeros_(prm)
                elif prm.dim() >= 2:  # LayerNorm gains keep their 1
                    std = 0.02 / math.sqrt(2 * L) if name.endswith(("proj.weight", "fcproj.weight")) else 0.02
                    nn.init.normal_(prm, 0.0, std)

        def forward(self, idx, targets):
            T = idx.shape[1]
            x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
            for b in self.blocks:
                x = b(x)
            logits = F.linear(self.lnf(x), self.wte.weight)  # the tied LM head
            return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))

    return GPT(cfg)


def param_groups(model, weight_decay):
    """Decay on matrices (embeddings, linear weights), none on biases and LayerNorms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]


def make_batches(torch, a):
    """--steps batches of [B, T+1] tokens, the same for every mode (inputs and shifted targets)."""
    g = torch.Generator().manual_seed(a.seed)
    n = a.batch * (a.seq + 1)
    if a.data:
        with open(a.data, "rb") as f:
            data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
        if data.numel() < a.seq + 1:
            print(f"torch_gpt: --data {a.data} has {data.numel()} bytes, fewer than --seq + 1", file=sys.stderr)
            sys.exit(2)
        out = []
        for _ in range(a.steps):
            starts = torch.randint(0, data.numel() - a.seq, (a.batch,), generator=g)
            out.append(torch.stack([data[s : s + a.seq + 1] for s in starts.tolist()]))
        return out
    return [torch.randint(0, VOCAB, (n,), generator=g).view(a.batch, a.seq + 1) for _ in range(a.steps)]


class Runner:
    """Times a mode's steps: forward + backward + optimizer, synchronised, with the mode's step()."""

    def __init__(self, torch, a, dev):
        self.torch, self.a, self.dev = torch, a, dev
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[a.precision]

    def autocast(self):
        # fp32: autocast off (its dtype argument is then unused, but must be one autocast accepts)
        return self.torch.autocast(self.dev.type, dtype=self.dtype or self.torch.bfloat16, enabled=self.dtype is not None)

    def sync(self):
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()

    def run(self, batches, step):
        """step(x, y) -> loss (a float). Returns the per-step seconds and losses."""
        secs, losses = [], []
        for b in batches:
            x = b[:, :-1].to(self.dev, non_blocking=True)
            y = b[:, 1:].to(self.dev, non_blocking=True)
            self.sync()
            t0 = time.perf_counter()
            loss = step(x, y)
            self.sync()
            secs.append(time.perf_counter() - t0)
            losses.append(loss)
        return secs, losses


def adamw_impl(torch, dev):
    """fused on the device when this torch has it there, else foreach."""
    import inspect

    if "fused" in inspect.signature(torch.optim.AdamW).parameters and dev.type == "cuda":
        return {"fused": True}, "torch.optim.AdamW(fused)"
    return {"foreach": True}, "torch.optim.AdamW(foreach)"


def make_step(model, opt, scaler, runner):
    """One training step of `model` with `opt` (and a loss scaler for fp16): returns the loss."""

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with runner.autocast():
            loss = model(x, y)
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        return loss.item()

    return step


def mode_device(torch, a, dev, cfg, runner, batches):
    torch.manual_seed(a.seed)
    model = build_model(torch, cfg).to(dev)
    kw, name = adamw_impl(torch, dev)
    opt = torch.optim.AdamW(param_groups(model, a.weight_decay), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, **kw)
    scaler = torch.amp.GradScaler(dev.type) if a.precision == "fp16" else None
    return name, runner.run(batches, make_step(model, opt, scaler, runner))


def mode_deepspeed(torch, a, dev, cfg, runner, batches):
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # may build its C++ op on first use

    torch.manual_seed(a.seed)
    model = build_model(torch, cfg).to(dev)
    params = list(model.parameters())
    # fp32 master weights and their gradients in pinned host memory; DeepSpeedCPUAdam keeps m, v there
    master = [p.detach().to("cpu").pin_memory() for p in params]
    for m in master:
        m.grad = torch.zeros_like(m).pin_memory()
    decay = {id(p) for p in params if p.dim() >= 2}
    groups = [
        {"params": [m for p, m in zip(params, master) if id(p) in decay], "weight_decay": a.weight_decay},
        {"params": [m for p, m in zip(params, master) if id(p) not in decay], "weight_decay": 0.0},
    ]
    opt = DeepSpeedCPUAdam(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, adamw_mode=True)
    # fp16: dynamic loss scaling by hand (GradScaler wants the optimizer to own the GPU gradients)
    scale = [2.0**16 if a.precision == "fp16" else 1.0, 0]

    def step(x, y):
        for p in params:
            p.grad = None
        with runner.autocast():
            loss = model(x, y)
        (loss * scale[0]).backward()
        if a.precision == "fp16":
            finite = torch.stack([torch.isfinite(p.grad).all() for p in params]).all().item()
            if not finite:  # skip the step, halve the scale
                scale[0], scale[1] = scale[0] / 2, 0
                return loss.item()
            scale[1] += 1
        for p, m in zip(params, master):
            m.grad.copy_(p.grad, non_blocking=True)
        torch.cuda.synchronize()
        if scale[0] != 1.0:
            for m in master:
                m.grad.mul_(1.0 / scale[0])
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m, non_blocking=True)
        if a.precision == "fp16" and scale[1] >= 2000:
            scale[0], scale[1] = scale[0] * 2, 0
        return loss.item()

    return "DeepSpeedCPUAdam(adamw, pinned fp32 master)", runner.run(batches, step)


def mode_fsdp(torch, a, dev, cfg, runner, batches):
    import torch.distributed as dist

    if not dist.is_available():
        raise Skip("torch.distributed is not available in this torch build")
    from torch.distributed.fsdp import CPUOffload
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    backend = "nccl" if dist.is_nccl_available() else "gloo"
    tmp = tempfile.mkdtemp(prefix="torch_gpt_store.")
    try:
        try:
            dist.init_process_group(backend, store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        except Exception as e:  # noqa: BLE001 - any failure means this mode cannot run here
            raise Skip(f"one-rank process group ({backend}) failed: {type(e).__name__}: {e}") from e
        try:
            torch.manual_seed(a.seed)
            model = build_model(torch, cfg)  # on the CPU: FSDP keeps the parameters there
            matrices = {n for n, p in model.named_parameters() if p.dim() >= 2}
            with warnings.catch_warnings():
                # FSDP1 is deprecated in favour of fully_shard, and says it uses NO_SHARD on one rank
                warnings.simplefilter("ignore", FutureWarning)
                warnings.simplefilter("ignore", UserWarning)
                fsdp = FSDP(model, cpu_offload=CPUOffload(offload_params=True), device_id=dev, use_orig_params=True)
            # Decay by the original names: FSDP may hand out flattened views of the parameters.
            named = [(n.replace("_fsdp_wrapped_module.", ""), p) for n, p in fsdp.named_parameters()]
            groups = [
                {"params": [p for n, p in named if n in matrices], "weight_decay": a.weight_decay},
                {"params": [p for n, p in named if n not in matrices], "weight_decay": 0.0},
            ]
            if len(groups[0]["params"]) != len(matrices):
                raise RuntimeError(f"FSDP renamed the parameters: {[n for n, _ in named][:4]}...")
            # The parameters (and their gradients) live on the CPU: AdamW steps there.
            opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)
            scaler = None
            if a.precision == "fp16":
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                scaler = ShardedGradScaler()

            return f"FSDP(CPUOffload(offload_params=True), {backend}, 1 rank) + torch.optim.AdamW(foreach) on the CPU", runner.run(
                batches, make_step(fsdp, opt, scaler, runner)
            )
        finally:
            dist.destroy_process_group()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def mode_cpu_optimizer(torch, a, dev, cfg, runner, batches):
    if dev.type != "cuda":
        raise Skip("needs --device cuda (with --device cpu the optimizer is on the CPU in the device mode already)")
    notes = []
    if importlib.util.find_spec("deepspeed") is not None:
        try:
            return mode_deepspeed(torch, a, dev, cfg, runner, batches)
        except Exception as e:  # noqa: BLE001 - fall back to FSDP, saying why
            notes.append(f"DeepSpeedCPUAdam failed ({type(e).__name__}: {e})")
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
    else:
        notes.append("deepspeed is not installed")
    try:
        name, res = mode_fsdp(torch, a, dev, cfg, runner, batches)
    except Skip as s:
        raise Skip("; ".join(notes + [str(s)])) from s
    return name + (f" [{'; '.join(notes)}]" if notes else ""), res


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import torch
    except ImportError as e:
        print(f"torch_gpt: SKIPPED: torch is not importable ({e})")
        return 77
    if a.device == "cuda" and not torch.cuda.is_available():
        print("torch_gpt: SKIPPED: --device cuda but torch.cuda.is_available() is False")
        return 77
    dev = torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
    cfg = dict(PRESETS[a.preset], vocab=VOCAB)
    nparams = sum(p.numel() for p in build_model(torch, cfg).parameters())
    gpu = torch.cuda.get_device_name(dev) if a.device == "cuda" else None
    print(
        f"torch_gpt: preset {a.preset} (L{cfg['layers']} NH{cfg['heads']} C{cfg['width']} T{cfg['context']}, "
        f"{nparams / 1e6:.2f}M params), batch {a.batch} x seq {a.seq}, {a.steps} steps, {a.precision}, "
        f"{a.device}{f' ({gpu})' if gpu else ''}, torch {torch.__version__}; "
        f"data: {a.data or f'random tokens, seed {a.seed}'}",
        flush=True,
    )
    batches = make_batches(torch, a)
    runner = Runner(torch, a, dev)
    tokens = a.batch * a.seq
    results, failed = [], False
    impls = {"device": mode_device, "cpu_optimizer": mode_cpu_optimizer}
    for mode in a.modes:
        r = {"mode": mode}
        if a.device == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        try:
            name, (secs, losses) = impls[mode](torch, a, dev, cfg, runner, batches)
            timed = secs[WARMUP_STEPS:]
            med = statistics.median(timed)
            r.update(
                status="ok",
                optimizer=name,
                tokens_per_s=tokens / med,
                step_s_median=med,
                peak_gpu_bytes=torch.cuda.max_memory_allocated(dev) if a.device == "cuda" else None,
                first_loss=losses[0],
                last_loss=losses[-1],
                losses=losses,
                step_s=secs,
            )
        except Skip as s:
            r.update(status="skipped", reason=str(s))
        except Exception as e:  # noqa: BLE001 - report the mode as failed, go on with the others
            r.update(status="failed", reason=f"{type(e).__name__}: {e}")
            failed = True
        results.append(r)
        if r["status"] == "ok":
            peak = f"{r['peak_gpu_bytes'] / 2**20:.1f} MiB" if r["peak_gpu_bytes"] is not None else "-"
            print(
                f"  {mode:<14} {r['tokens_per_s']:>12.0f} tokens/s  {1e3 * med:8.2f} ms/step  peak GPU {peak:>12}  "
                f"loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}  [{name}]",
                flush=True,
            )
        else:
            print(f"  {mode:<14} {r['status']}: {r['reason']}", flush=True)

    if a.json:
        doc = {
            "config": {
                "preset": a.preset,
                **cfg,
                "params": nparams,
                "batch": a.batch,
                "seq": a.seq,
                "steps": a.steps,
                "warmup_steps": WARMUP_STEPS,
                "precision": a.precision,
                "device": a.device,
                "gpu": gpu,
                "torch": torch.__version__,
                "lr": a.lr,
                "weight_decay": a.weight_decay,
                "seed": a.seed,
                "data": a.data or "random",
            },
            "modes": results,
        }
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
