"""Benchmark `laionkit train` on the flow-matching transformers (SD3, Flux) against the bare diffusers step
(not a test; results in docs/BENCHMARKS.md).

Per family, at real size and random init (``--transformer-config sd3-medium``: 2.0B; ``flux-dev``: 11.9B;
``pixart-sigma-xl``: 0.61B, stored vs online text only),
bf16, per resolution (1024 px and 512 px):

(peak)    the bf16 matmul peak of this GPU (torch.mm, 8192^3), measured in this run: MFU is against it.
(a)       the ceiling, bare diffusers + torch, no laionkit code: the transformer ``from_config``, flow matching
          as diffusers' train_dreambooth_sd3.py / train_dreambooth_flux.py compute it (logit-normal sigma via
          ``compute_density_for_timestep_sampling``, the family's shift, x_t = (1 - s) x0 + s e, target e - x0,
          MSE; Flux: 2x2-packed latents, img_ids / txt_ids, guidance 3.5), backward, fused AdamW, on tensors
          already on the GPU; the whole model in bf16 (the fastest bare step). Eager, and compiled per block
          (``block.compile()``, as torchtitan's Flux does).
(b)       `laionkit train` on latent shards with stored text (``encode --text stored``), eager and compiled.
(online)  the same on ``encode --text online`` latents: the frozen text encoders (real sizes: CLIP-L,
          CLIP-G, T5-XXL for SD3; CLIP-L, T5-XXL for Flux, random init) run in the train loop.
(fp8)     `laionkit train --fp8` against the same run in bf16, compiled, over ``--fp8-steps`` steps on the same
          data: samples/s and the two loss curves (mean |difference| against the bf16 run's own step noise).
(big)     Flux only: the largest configurations that train on this GPU, samples/s, MFU and peak memory: LoRA
          rank 64 on the whole 12B with stored and with online text per resolution (Flux's stored vs online
          comparison), full-parameter 12B under ``--full-bf16``, and a full-parameter depth fraction under
          the default policy (fp32 master weights), all with ``--checkpointing blocks``.

The latents come from `laionkit encode` of generated photos with a tiny 16-channel VAE (8x, like SD3's and
Flux's) and real-size text encoders: the train step sees real shapes, and online text costs what it would.
Every measurement runs in its own process.

    python scripts/bench_train_flow.py --family sd3 --out /tmp/flow --report $OUT        # GPU machine
    python scripts/bench_train_flow.py --family sd3 --smoke --out /tmp/flow-smoke         # CPU plumbing check
    python scripts/bench_train_flow.py --family pixart --parts online --out /tmp/pixart   # stored vs online only
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import child_argv, family_bench_parser, measurer, print_table, save_results, time_bare_step  # noqa: E402
from bench_train_sdxl import prepare  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BATCH = {"sd3": {1024: 8, 512: 32, 64: 2}, "flux": {1024: 1, 512: 4, 64: 2}, "pixart": {1024: 16, 512: 64, 64: 2}}
CONFIG = {"sd3": "sd3-medium", "flux": "flux-dev", "pixart": "pixart-sigma-xl"}
LORA_BATCH = {1024: 4, 512: 16}  # Flux-12B LoRA with --checkpointing blocks
FRACTIONS = ((8, 16),)  # Flux depth fractions (double, single blocks) trained full-parameter, default policy


def real_text_encoders(family: str, folder: Path, layers: int | None = None, dtype=torch.bfloat16) -> None:
    """Replace the tiny writer's text encoders by real-size ones (random init, saved in ``dtype``): CLIP-L
    (768, 12 layers; SD 1.x alone), CLIP-G (1280, 32 layers; SD3), T5-XXL (4096, 24 layers, 10240 ff).
    ``layers``: that many layers each instead (the real widths, so the stored text has the real shapes, at a
    fraction of the build time; bench_learning.py, which saves them in float32 as the rest of the pipeline
    is: a pipeline loaded without a torch_dtype runs each part in its saved dtype)."""
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
    )

    from laionkit.common.models import CLIP_VOCAB_SIZE, CLIP_WINDOW

    def clip(cls, hidden, real_layers, act):
        return cls(CLIPTextConfig(vocab_size=CLIP_VOCAB_SIZE, hidden_size=hidden, intermediate_size=4 * hidden,
                                  num_hidden_layers=layers or real_layers, num_attention_heads=hidden // 64, projection_dim=hidden,
                                  max_position_embeddings=CLIP_WINDOW, hidden_act=act, bos_token_id=49406,
                                  eos_token_id=49407, pad_token_id=1))

    t5 = lambda: T5EncoderModel(T5Config(  # noqa: E731 - google/t5-v1_1-xxl's encoder
        vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=layers or 24, num_heads=64,
        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, is_encoder_decoder=False))
    if family == "sd3":
        parts = {"text_encoder": lambda: clip(CLIPTextModelWithProjection, 768, 12, "quick_gelu"),
                 "text_encoder_2": lambda: clip(CLIPTextModelWithProjection, 1280, 32, "gelu"),
                 "text_encoder_3": t5}
    elif family == "sd":  # SD 1.x: CLIP-L's last hidden state
        parts = {"text_encoder": lambda: clip(CLIPTextModel, 768, 12, "quick_gelu")}
    elif family == "flux":
        parts = {"text_encoder": lambda: clip(CLIPTextModel, 768, 12, "quick_gelu"), "text_encoder_2": t5}
    else:  # pixart: T5-XXL alone
        parts = {"text_encoder": t5}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for sub, build in parts.items():
        torch.manual_seed(0)
        with torch.device(device):
            model = build().to(dtype)
        shutil.rmtree(folder / sub)
        model.save_pretrained(folder / sub)
        del model


def write_models(folder: Path, family: str, smoke: bool) -> Path:
    from laionkit.families import get_family

    if not (folder / "model_index.json").exists():
        get_family(family).write_tiny(folder, 0)
        if not smoke:
            real_text_encoders(family, folder)
    return folder


# --- children: one measurement per process ---------------------------------------------------------

def child_peak(args) -> dict:
    """bf16 matmul TFLOP/s of this GPU: the best of a few 8192^3 torch.mm runs."""
    if not torch.cuda.is_available():
        return {"peak_tflops": 0.0}
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    best = 0.0
    for _ in range(5):
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(50):
            a @ b
        torch.cuda.synchronize()
        best = max(best, 2 * n**3 * 50 / (time.perf_counter() - started) / 1e12)
    return {"peak_tflops": best}


@dataclass
class Bare:
    """One family's bare step: its latent x0 [B, C, h, w] on the device, ``forward(model, noisy, sigma, rows)``
    (the velocity for the first ``rows`` samples, in x0's layout, called as diffusers' training script calls
    the transformer) and the shift its sigmas are drawn with."""

    x0: torch.Tensor
    forward: Callable
    shift: float


def bare_sd3(arch: dict, resolution: int, batch: int, smoke: bool, device, dtype) -> Bare:
    """SD3: 16 channels at 8x, CLIP-L + CLIP-G (77) and T5 (256) states and pooled, timestep sigma x 1000, shift 3."""
    latent = resolution // 8
    arch.update(sample_size=latent, pos_embed_max_size=max(arch["pos_embed_max_size"], latent // 2))
    text_len = 77 + (16 if smoke else 256)
    states = torch.randn(batch, text_len, arch["joint_attention_dim"], device=device, dtype=dtype)
    pooled = torch.randn(batch, arch["pooled_projection_dim"], device=device, dtype=dtype)

    def forward(model, noisy, sigma, rows):
        return model(hidden_states=noisy, timestep=sigma * 1000, encoder_hidden_states=states[:rows],
                     pooled_projections=pooled[:rows], return_dict=False)[0]

    return Bare(torch.randn(batch, 16, latent, latent, device=device, dtype=dtype), forward, 3.0)


def bare_flux(arch: dict, resolution: int, batch: int, smoke: bool, device, dtype) -> Bare:
    """Flux: 16 channels at 8x packed 2x2 with img_ids / txt_ids, T5 (512) states and CLIP pooled, guidance 3.5,
    timestep sigma, train_dreambooth_flux.py's resolution shift."""
    from diffusers import FluxPipeline

    latent = resolution // 8
    text_len = 16 if smoke else 512
    states = torch.randn(batch, text_len, arch["joint_attention_dim"], device=device, dtype=dtype)
    pooled = torch.randn(batch, arch["pooled_projection_dim"], device=device, dtype=dtype)
    ids = FluxPipeline._prepare_latent_image_ids(batch, latent // 2, latent // 2, device, dtype)
    txt_ids = torch.zeros(text_len, 3, device=device, dtype=dtype)
    guidance = torch.full((batch,), 3.5, device=device, dtype=torch.float32)
    mu = (1.15 - 0.5) / (4096 - 256) * ((latent // 2) ** 2 - 256) + 0.5  # train_dreambooth_flux's mu

    def forward(model, noisy, sigma, rows):
        packed = FluxPipeline._pack_latents(noisy, rows, 16, latent, latent)
        out = model(hidden_states=packed, timestep=sigma, guidance=guidance[:rows], pooled_projections=pooled[:rows],
                    encoder_hidden_states=states[:rows], txt_ids=txt_ids, img_ids=ids, return_dict=False)[0]
        return FluxPipeline._unpack_latents(out, resolution, resolution, 8)

    return Bare(torch.randn(batch, 16, latent, latent, device=device, dtype=dtype), forward,
                float(torch.tensor(mu).exp()))


BARE = {"sd3": bare_sd3, "flux": bare_flux}


def child_bare(args) -> dict:
    """(a): the bare diffusers flow-matching step on in-GPU tensors, whole model in bf16."""
    import diffusers
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from laionkit.families import get_family

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    spec = get_family(args.family)
    if not spec.cudnn_attention:  # its backward fails there (Flux): the fastest bare step that runs
        torch.backends.cuda.enable_cudnn_sdp(False)
    arch = dict(spec.configs["tiny" if args.smoke else CONFIG[args.family]])
    dtype = torch.bfloat16 if cuda else torch.float32
    batch = args.batch
    bare = BARE[args.family](arch, args.resolution, batch, args.smoke, device, dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(diffusers, spec.denoiser_class).from_config(arch).to(dtype)
    model.train()
    if args.compile:
        for block in spec.blocks(model):
            block.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    x0, shift = bare.x0, bare.shift

    def step():
        noise = torch.randn_like(x0)
        u = compute_density_for_timestep_sampling("logit_normal", batch, logit_mean=0.0, logit_std=1.0).to(device)
        sigma = shift * u / (1 + (shift - 1) * u)
        s = sigma.view(-1, 1, 1, 1).to(dtype)
        pred = bare.forward(model, (1 - s) * x0 + s * noise, sigma.to(dtype), batch)
        loss = torch.nn.functional.mse_loss(pred.float(), (noise - x0).float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def one_sample():
        bare.forward(model, x0[:1], torch.full((1,), 0.5, device=device, dtype=dtype), 1).float().sum().backward()

    return time_bare_step(step, one_sample, model, args.steps, args.warmup, batch, device)


def main() -> None:
    parser = family_bench_parser(__doc__)
    parser.add_argument("--family", choices=sorted(BATCH), default="sd3")
    parser.add_argument("--parts", default="peak,a,b,online,fp8", help="comma list of peak, a, b, online, fp8, big")
    parser.add_argument("--modes", default="eager,compiled", help="(a) and (b) at the first resolution")
    parser.add_argument("--fp8-steps", type=int, default=200)
    parser.add_argument("--fp8-resolution", type=int, default=512)
    parser.add_argument("--fp8-batch", type=int, default=16)
    parser.add_argument("--child", choices=["bare", "peak"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        result = child_bare(args) if args.child == "bare" else child_peak(args)
        (args.out / f"{args.name}.json").write_text(json.dumps(result))
        return

    started = time.perf_counter()
    if args.smoke:
        args.resolutions, args.images, args.steps, args.fp8_steps, args.fp8_resolution = [64], 16, 3, 4, 64
    family = args.family
    batch_of = lambda resolution: BATCH[family].get(resolution, 2)  # noqa: E731
    parts = set(args.parts.split(","))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    models = write_models(args.out / "models", family, args.smoke)
    print(f"models ready after {time.perf_counter() - started:.0f} s", flush=True)
    results: dict[str, dict] = {}
    measure = measurer(args.out, args.budget, started, env, results, show=300, report=args.report)

    def train(name: str, latents: Path, batch: int, *extra: str, steps: int | None = None,
              config: str | None = None, log_every: int | None = None) -> Path:
        run = args.out / f"run-{name}"
        window = max(2, args.steps // 3)
        total = steps or window * 4
        measure(name, [sys.executable, "-m", "laionkit.cli", "train", str(latents), "--output", str(run),
                       "--transformer-config", "tiny" if args.smoke else (config or CONFIG[family]),
                       "--batch-size", str(batch), "--max-steps", str(total), "--log-every", str(log_every or window),
                       "--checkpoint-every", str(10**9), "--log-with", "none", "--quiet", "--workers", "4",
                       "--shuffle-buffer", "64", "--mixed-precision", "no" if args.smoke else "bf16", *extra], run)
        return run

    first = args.resolutions[0]
    if "peak" in parts:
        measure("peak", child_argv(args.out, "peak", "peak", script=__file__))
    for mode in args.modes.split(","):
        compiled = mode == "compiled"
        flags = ["--compile", "--bf16-weights"] if compiled else []
        if "a" in parts:
            measure(f"a-{first}-{mode}", child_argv(args.out, f"a-{first}-{mode}", "bare", script=__file__,
                                                    family=family, resolution=first, batch=batch_of(first),
                                                    steps=args.steps, compile=compiled, smoke=args.smoke))
        if "b" in parts:
            train(f"b-{first}-{mode}", prepare(args.out, first, args.images, False, models, "stored"),
                  batch_of(first), *flags)
    for resolution in args.resolutions:
        for text in ("stored", "online") if "online" in parts else ():
            if text == "stored" and resolution == first and "b" in parts:
                continue  # b-<first>-eager is this row
            train(f"{text}-{resolution}-eager", prepare(args.out, resolution, args.images, False, models, text),
                  batch_of(resolution))
    if "fp8" in parts:
        latents = prepare(args.out, args.fp8_resolution, args.images, False, models, "stored")
        common = ["--compile", "--bf16-weights", "--seed", "0"]
        window = max(1, args.fp8_steps // 10)
        for name, extra in (("fp8-off", []), ("fp8-on", ["--fp8"])):
            train(name, latents, args.fp8_batch, *common, *extra, steps=args.fp8_steps, log_every=1)
            logged = args.out / f"{name}-metrics.jsonl"  # measure's copy of the run's metrics.jsonl
            if logged.exists():
                records = [json.loads(line) for line in logged.read_text().splitlines()]
                results[name]["losses"] = [record["loss"] for record in records]
                rates = [record["samples_per_s"] for record in records]
                results[name]["samples_per_s"] = statistics.median(rates[window:]) if len(rates) > window else None
    if "big" in parts and family == "flux":
        latents = prepare(args.out, first, args.images, False, models, "stored")
        # Full-parameter: the default policy (bf16 weights, fp32 master + AdamW) needs 20 bytes per parameter,
        # 238 GB for 11.9B: a depth fraction fits; --full-bf16 (8 bytes per parameter, 95 GB) fits all 12B.
        train(f"big-full-12b-fullbf16-{first}", latents, 1, "--full-bf16", "--mixed-precision", "bf16",
              "--checkpointing", "blocks")
        # LoRA rank 64 on the whole 12B (frozen bf16 base, checkpointed blocks): the single-GPU Flux run, and
        # the one where stored vs online text is measured for Flux (full-parameter 12B fits only below).
        for resolution in args.resolutions:
            for text in ("stored", "online"):
                train(f"big-lora64-12b-{text}-{resolution}", prepare(args.out, resolution, args.images, False,
                                                                      models, text),
                      LORA_BATCH.get(resolution, 2), "--lora-rank", "64", "--lora-random-base",
                      "--checkpointing", "blocks")
        for layers, single in FRACTIONS:
            arch = {**__import__("laionkit.families.flux", fromlist=["x"]).TRANSFORMER_CONFIG,
                    "num_layers": layers, "num_single_layers": single}
            path = args.out / f"flux-{layers}-{single}.json"
            path.write_text(json.dumps(arch))
            train(f"big-full-{layers}x{single}-{first}", latents, 1, "--checkpointing", "blocks", config=str(path))

    summary = {"date": time.strftime("%Y-%m-%d"), "family": family, "device": torch.cuda.get_device_name(0)
               if torch.cuda.is_available() else "cpu", "torch": torch.__version__, "results": results}
    save_results(summary, args.out, args.report, suffix=f"-{family}", tail=8000)
    print_table({k: v for k, v in results.items() if k != "peak"}, f"{summary['device']}, torch {torch.__version__}")
    rate = lambda name: results.get(name, {}).get("samples_per_s")  # noqa: E731
    peak = results.get("peak", {}).get("peak_tflops")
    print(f"\nmeasured bf16 matmul peak: {peak}")
    for mode in args.modes.split(","):
        a, b = rate(f"a-{first}-{mode}"), rate(f"b-{first}-{mode}")
        if a and b:
            flops = results[f"a-{first}-{mode}"]["flops_per_sample"]
            print(f"  b/a {first} {mode}: {b / a:.3f} (target >= 0.98); b model TFLOP/s {flops * b / 1e12:.0f}"
                  + (f" = {flops * b / 1e12 / peak:.2f} x the measured peak (target >= 0.5)" if peak else ""))
    for resolution in args.resolutions:
        stored = rate(f"stored-{resolution}-eager") or rate(f"b-{resolution}-eager")
        online = rate(f"online-{resolution}-eager")
        if stored and online:
            print(f"  online/stored text {resolution}: {online / stored:.3f}")
    if rate("fp8-on") and rate("fp8-off"):
        on, off = results["fp8-on"]["losses"], results["fp8-off"]["losses"]
        tail = len(off) // 2
        print(f"  fp8 speed-up: {rate('fp8-on') / rate('fp8-off'):.3f}; mean loss, second half: fp8 "
              f"{statistics.mean(on[tail:]):.4f} vs bf16 {statistics.mean(off[tail:]):.4f} (bf16 step-to-step "
              f"std {statistics.pstdev(off[tail:]):.4f})")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
