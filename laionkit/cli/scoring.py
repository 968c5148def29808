"""`laionkit score`: per-sample scores, hashes and CLIP embeddings from the images of existing shards."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from laionkit.cli.app import QuietOption, RankOption, StorageOption, WorldSizeOption, app, err_console


@app.command("score", epilog="""Examples:

    laionkit score out/shards --output out/scored --score aesthetic=aesthetic-v2:sac+logos+ava1-l14-linearMSE.pth --watermark watermark_model_v1.pt --nsfw clip_l14_nsfw_head.safetensors

    laionkit score 'out/shards/{00000..00099}.tar' --output out/scored --score anime="prompt:an anime drawing|a manga page"

    torchrun --nproc-per-node 8 -m laionkit.cli score s3://bucket/shards --output s3://bucket/scored --batch-size 512   # one rank per GPU

    laionkit filter out/shards --scores out/scored --where "aesthetic >= 5 AND pwatermark < 0.5" --output out/kept   # join by key

    laionkit filter out/scored/scores --embeddings out/scored/img_emb --score aes1=aesthetic-v1:sa_0_4_vit_l_14_linear.pth --output out/aes1

    laionkit models tiny-eval --output m && laionkit score out/shards --output s --clip-model m/tiny-clip.json --clip-pretrained m/tiny-clip.safetensors   # offline
""")
def score(
    shards: Annotated[list[str], typer.Argument(help="pack's / img2dataset's shard folder(s), tar files, globs or {a..b} "
                                                "patterns (paths or URLs); plain WebDataset tars too.")],
    output: Annotated[str, typer.Option("--output", "-o", help="Output folder (a path or URL): scores/, img_emb/, "
                                        "records/, stats.json (docs/FORMATS.md section 6).")],
    clip_model: Annotated[str, typer.Option(help="open_clip model: a name (ViT-L-14), hf-hub:ORG/REPO or a model "
                                            "config .json.")] = "ViT-L-14",
    clip_pretrained: Annotated[str, typer.Option(help="open_clip weights: a tag (openai) or a weights file "
                                                 "(.safetensors, .pt); 'none' = random init.")] = "openai",
    score_spec: Annotated[Optional[list[str]], typer.Option(
        "--score", help="NAME=KIND:ARG as filter's: aesthetic-v2, aesthetic-v1, head (a weights path) or prompt "
        "(text, a|b); computed from the stored embeddings; repeatable.")] = None,
    watermark: Annotated[Optional[str], typer.Option(
        help="LAION's watermark detector weights (watermark_model_v1.pt or .safetensors): adds pwatermark.")] = None,
    nsfw: Annotated[Optional[str], typer.Option(
        help="LAION's CLIP NSFW head weights (norm.mean/variance, linear_1..4; .safetensors or .pt): adds punsafe.")] = None,
    batch_size: Annotated[int, typer.Option(help="Images per device batch.")] = 256,
    workers: Annotated[int, typer.Option(help="DataLoader worker processes that decode (each reads whole shards).")] = 4,
    dtype: Annotated[str, typer.Option(help="auto (bf16 autocast on CUDA, fp32 on CPU), fp32, fp16, bf16.")] = "auto",
    device: Annotated[Optional[str], typer.Option(help="torch device (default: cuda:LOCAL_RANK, else cpu).")] = None,
    decode: Annotated[str, typer.Option(
        help="exact: full-size decode (pHash = imagehash's, CLIP input = open_clip's preprocess of the file); draft: "
        "JPEGs decoded at a reduced DCT scale that keeps the short side >= the models' input: several times less "
        "CPU per large JPEG, values slightly different.")] = "exact",
    caption_key: Annotated[Optional[str], typer.Option(
        help="Where captions are (a member or a json key); default: .txt, .caption, json caption / text / TEXT.")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Redo shards scored with other settings; also write into another stage's folder.")] = False,
    storage_options: StorageOption = None,
    rank: RankOption = None,
    world_size: WorldSizeOption = None,
    quiet: QuietOption = False,
) -> None:
    """Decode each image once and write per sample: key, source row, size, sha256, pHash, CLIP embedding
    (float16 npy, LAION's embeddings layout), caption similarity, pwatermark, punsafe and --score columns;
    rank-sharded and resumable per shard."""
    from laionkit.score import ScoreConfig, run

    config = ScoreConfig(
        shards=tuple(shards), output=output, clip_model=clip_model,
        clip_pretrained=None if clip_pretrained.lower() == "none" else clip_pretrained, scores=tuple(score_spec or ()),
        watermark=watermark, nsfw=nsfw, batch_size=batch_size, workers=workers, dtype=dtype, device=device,
        decode=decode, caption_key=caption_key, rank=rank, world_size=world_size, overwrite=overwrite, quiet=quiet,
        storage_options=storage_options,
    )
    summary = run(config, log=lambda line: err_console.print(line, highlight=False))
    if not quiet:
        err_console.print(f"scored {summary['samples_out']} samples ({summary['skipped']} skipped) from "
                          f"{summary['shards']} shards into {output}", highlight=False)
