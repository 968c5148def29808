"""laionkit score's options: one frozen ``ScoreConfig`` per run, built by the CLI and taken by ``run``."""

from __future__ import annotations

from dataclasses import dataclass

from laionkit.common import LaionkitError
from laionkit.common.caption_mix import list_names

COMPUTE_DTYPES = ("auto", "fp32", "fp16", "bf16")
# exact: every image decoded at full size (pHash = imagehash's, CLIP input = open_clip's own preprocess of the
# file); draft: JPEGs decoded at a reduced DCT scale (libjpeg's 1/2, 1/4, 1/8) that keeps the short side >= what
# the models take (CLIP's side, 256 px for the watermark detector): several times less CPU per large JPEG,
# deterministic, but pHash bits and embeddings differ slightly from a full decode's; device: workers only read and
# hash, JPEGs are decoded and resized on the stage's device (nvJPEG on CUDA; laionkit.score.pixels), for hosts
# whose CPUs cannot keep the GPU fed: pixels differ from exact's by a few levels, a pHash bit at times;
# draft-device: the workers decode as draft does and ship the RGB, the device resizes it and computes the pHash
# (laionkit.score.pixels): the half of draft's worker time that is resizing moves to the GPU, the decode stays on
# the CPU cores (how the modes compare on a GPU host: docs/BENCHMARKS.md, score).
DECODE_MODES = ("exact", "draft", "device", "draft-device")
DEVICE_PIXEL_MODES = ("device", "draft-device")  # the device makes the model inputs and the pHash


@dataclass(frozen=True)
class ScoreConfig:
    shards: tuple[str, ...]
    output: str
    clip_model: str = "ViT-L-14"  # open_clip name, hf-hub:ORG/REPO or a model config .json
    clip_pretrained: str | None = "openai"  # a tag open_clip knows or a weights file; None: random init (tests)
    scores: tuple[str, ...] = ()  # NAME=KIND:ARG as filter's --score (laionkit.common.clip_scores)
    watermark: str | None = None  # LAION watermark detector weights; None: no pwatermark column
    nsfw: str | None = None  # LAION CLIP NSFW head weights; None: no punsafe column
    batch_size: int = 256
    workers: int = 4
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    device: str | None = None
    decode: str = "exact"  # DECODE_MODES
    # CLIP's image and caption forwards replayed from CUDA graphs (laionkit.common.cudagraphs): one launch a batch
    # instead of ~700 from the thread that also feeds the loop; opt-in until measured (docs/BENCHMARKS.md, score)
    cuda_graphs: bool = False
    # CLIP's image forward under torch.compile for full batches (a shard's ramping first batches and its last one
    # stay eager: one graph, no recompiles); opt-in: for ViT-L/14 it was no faster (docs/BENCHMARKS.md, score)
    compile: bool = False
    caption_key: str | None = None  # where captions are (encode's --caption-key); None: reader.caption_of's order
    # --captions alt,vlm: a similarity_NAME column per named caption (laionkit.common.caption_mix' names, resolved as encode
    # resolves them), for encode --caption-scores; None: only the default caption's similarity
    captions: tuple[str, ...] | str | None = None
    rank: int | None = None
    world_size: int | None = None
    overwrite: bool = False
    quiet: bool = False
    allow_incomplete: bool = False  # use an unfinished pack or caption input folder (common.upstream)
    storage_options: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "captions", list_names(self.captions))
        if self.dtype not in COMPUTE_DTYPES:
            raise LaionkitError(f"--dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {self.dtype!r}")
        if self.decode not in DECODE_MODES:
            raise LaionkitError(f"--decode must be one of {', '.join(DECODE_MODES)}, got {self.decode!r}")
        if self.batch_size < 1 or self.workers < 0:
            raise LaionkitError("--batch-size must be >= 1 and --workers >= 0")
