"""The data stages, in the order data flows: `laionkit filter`, `pack`, `score`, `dedup`, `caption`, `encode`,
and `stats`."""

from __future__ import annotations

import inspect
from typing import Annotated, Optional

import typer

from laionkit.caption import CaptionConfig
from laionkit.cli.app import (
    CONFIG_ONLY,
    AllowIncompleteOption,
    QuietOption,
    RankOption,
    StorageOption,
    WorldSizeOption,
    app,
    err_console,
)
from laionkit.common import available_cpus
from laionkit.common.options import typer_parameters


@app.command("filter", epilog="""More examples:

    laionkit filter metadata/ --embeddings img_emb/ --score aes=aesthetic-v2:sac+logos+ava1-l14-linearMSE.pth --where "aes >= 6" --output out/aes6

    laionkit filter metadata/ --embeddings img_emb/ --score anime="prompt:an anime drawing|a manga page" --where "anime > 0.3" --output out/anime

    torchrun --nproc-per-node 8 -m laionkit.cli filter laion/ --preset sd2 --output out/sd2   # 8 ranks, no coordinator

    torchrun --nproc-per-node 8 -m laionkit.cli filter laion/ --dedup URL --output out/unique   # exact, ranks meet via files

    laionkit filter s3://bucket/laion/ --preset sd2 --output s3://bucket/sd2   # AWS_* credentials / AWS_ENDPOINT_URL

    laionkit filter out/shards --scores out/scored --where "aes >= 5 AND pwatermark < 0.5" --output out/kept   # laionkit score's columns, by key
""")
def filter_command(
    inputs: Annotated[list[str], typer.Argument(help="Parquet files or folders (searched for *.parquet).")],
    output: Annotated[str, typer.Option("--output", "-o", help="Output folder.", rich_help_panel="Input and output")],
    where: Annotated[Optional[list[str]], typer.Option(
        "--where", help="One DuckDB SQL true/false expression over the input's columns, e.g. 'punsafe < 0.5' or "
        "'length(caption) >= 5' (no subqueries or file access); repeatable, AND-ed.", rich_help_panel="Rules")] = None,
    preset: Annotated[Optional[list[str]], typer.Option(
        "--preset", help="Rule set: laion-safe, sd1, sd2 (LAION; sd1/sd2 also on COYO-700M's columns), coyo-safe, "
        "datacomp-basic, datacomp-clip-l14-30, datacomp-clip-b32-30; combines with --where.", rich_help_panel="Rules")] = None,
    top: Annotated[Optional[list[str]], typer.Option(
        "--top", help="FRACTION:COLUMN: keep the rows whose COLUMN is in the top FRACTION of all inputs' rows with a "
        "value, exactly over all ranks (ties: earlier input row first), e.g. 0.3:clip_l14_similarity_score; "
        "repeatable, AND-ed with the other rules.", rich_help_panel="Rules")] = None,
    rename: Annotated[Optional[list[str]], typer.Option(
        "--rename", help="OLD=NEW: rename an input column (in rules and in the output).", rich_help_panel="Input and output")] = None,
    dedup: Annotated[Optional[str], typer.Option(
        help="Drop rows whose COLUMN value was already kept (global first occurrence, exact with any number of ranks).", rich_help_panel="Rules")] = None,
    dedup_wait: Annotated[float, typer.Option(
        help="--dedup: seconds a rank waits for the other ranks' partition / resolve outputs before it stops.", rich_help_panel="Rules")] = 3600.0,
    dedup_bucket_rows: Annotated[int, typer.Option(
        help="--dedup: input rows per hash bucket; one bucket is what a rank holds in memory to resolve it.", rich_help_panel="Rules")] = 4_000_000,
    embeddings: Annotated[Optional[list[str]], typer.Option(
        "--embeddings", help="CLIP image embeddings (.npy, N x D) aligned with the inputs: a file or a folder, a path or URL.", rich_help_panel="CLIP scores")] = None,
    score: Annotated[Optional[list[str]], typer.Option(
        "--score", help="NAME=KIND:ARG, KIND = aesthetic-v2, aesthetic-v1, head (weights path) or prompt (text, a|b).", rich_help_panel="CLIP scores")] = None,
    scores_dir: Annotated[Optional[list[str]], typer.Option(
        "--scores", help="`laionkit score` output folder(s): its per-sample columns (aesthetic, pwatermark, punsafe, "
        "similarity, phash, ...) joined onto the inputs by `key`, for rules, --top and --dedup like any column.", rich_help_panel="CLIP scores")] = None,
    clip_model: Annotated[str, typer.Option(help="open_clip model for prompt scores: a name (ViT-L-14), hf-hub:ORG/REPO, or a model config .json file.", rich_help_panel="CLIP scores")] = "ViT-L-14",
    clip_pretrained: Annotated[str, typer.Option(
        help="open_clip weights tag or file for prompt scores; 'none' = seeded random init (tests).", rich_help_panel="CLIP scores")] = "openai",
    unit_rows: Annotated[int, typer.Option(
        help="Merge row groups into work units of at least this many rows.", rich_help_panel="Distribution")] = 1_000_000,
    threads: Annotated[Optional[int], typer.Option(
        help="CPU threads for this rank (default: the CPUs it may use); units run in parallel, one thread each.", rich_help_panel="Distribution")] = None,
    skip_bad: Annotated[bool, typer.Option(
        "--skip-bad", help="Skip unreadable inputs (counted in stats) instead of stopping.", rich_help_panel="Input and output")] = False,
    allow_incomplete: AllowIncompleteOption = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Redo finished units instead of resuming; also write into a folder that holds another stage's outputs.", rich_help_panel="Input and output")] = False,
    storage_options: StorageOption = None,
    rank: RankOption = None,
    world_size: WorldSizeOption = None,
    quiet: QuietOption = False,
) -> None:
    """Keep the LAION rows that pass SQL rules, presets and custom CLIP scores; parquet parts + per-rule stats.

    Examples:

    ```
    laionkit filter laionkit/data/laion-sample.parquet --preset laion-safe --output out/filtered

    laionkit filter laion2B-en-aesthetic/ --preset sd1 --where "WIDTH / HEIGHT <= 2" \\
        --output out/sd1

    laionkit filter datacomp/metadata/ --preset datacomp-basic --top 0.3:clip_l14_similarity_score \\
        --output out/dc
    ```
    """
    from laionkit import filter as filter_stage

    config = filter_stage.FilterConfig(
        inputs=tuple(inputs), output=output, where=tuple(where or ()), presets=tuple(preset or ()), top=tuple(top or ()),
        rename=tuple(rename or ()), dedup=dedup, embeddings=tuple(embeddings or ()), scores=tuple(score or ()),
        score_tables=tuple(scores_dir or ()),
        clip_model=clip_model, clip_pretrained=clip_pretrained, unit_rows=unit_rows, threads=threads, rank=rank,
        world_size=world_size, dedup_wait=dedup_wait, dedup_bucket_rows=dedup_bucket_rows,
        skip_bad=skip_bad, overwrite=overwrite, quiet=quiet, storage_options=storage_options,
        allow_incomplete=allow_incomplete,
    )
    if CONFIG_ONLY.get():
        return
    stats = filter_stage.run(config)
    if not quiet:
        err_console.print(f"filter: kept {stats['rows_out']:,} of {stats['rows_in']:,} rows -> {output}")


@app.command(epilog="""More examples:

    srun --ntasks 4 laionkit pack filtered/ --output shards/   # 4 ranks (SLURM_PROCID / SLURM_NTASKS)

    laionkit pack local-urls.parquet --output shards/ --allow-private-hosts   # URLs on 127.0.0.1 / 10.x

    laionkit pack s3://bucket/filtered/ --output s3://bucket/shards/   # AWS_* credentials / AWS_ENDPOINT_URL

Rerun the same command after a crash: finished shards are kept, the rest are downloaded.
""")
def pack(
    inputs: Annotated[list[str], typer.Argument(help="Parquet files or folders of them (filter's output); paths or URLs.")],
    output: Annotated[str, typer.Option("--output", "-o", help="Folder for the WebDataset tar shards (a path or URL).", rich_help_panel="Input and output")],
    image_size: Annotated[int, typer.Option(help="Output image side in pixels.", rich_help_panel="Images")] = 512,
    resize_mode: Annotated[str, typer.Option(help="center_crop, keep_ratio, border or no.", rich_help_panel="Images")] = "center_crop",
    min_image_size: Annotated[int, typer.Option(help="Drop images whose shorter side is smaller.", rich_help_panel="Images")] = 0,
    max_aspect_ratio: Annotated[
        Optional[float], typer.Option(help="Drop images with a longer/shorter side ratio above this.", rich_help_panel="Images")
    ] = None,
    max_image_area: Annotated[
        int, typer.Option(help="Refuse images with more pixels, from their header (decompression bombs); 0: off.", rich_help_panel="Images")
    ] = 89_478_485,
    encode_format: Annotated[str, typer.Option(help="jpg or webp.", rich_help_panel="Images")] = "jpg",
    encode_quality: Annotated[int, typer.Option(help="Encoder quality, 0-100.", rich_help_panel="Images")] = 95,
    processes: Annotated[Optional[int], typer.Option(help="Download processes (default: CPU count).", rich_help_panel="Download")] = None,
    threads: Annotated[int, typer.Option(help="Download threads per process.", rich_help_panel="Download")] = 64,
    timeout: Annotated[
        float, typer.Option(help="Seconds one download may take in all (connect, redirects, body).", rich_help_panel="Download")
    ] = 10.0,
    max_bytes: Annotated[int, typer.Option(help="Refuse a response body larger than this many bytes.", rich_help_panel="Download")] = 64 * 2**20,
    allow_private_hosts: Annotated[bool, typer.Option(
        "--allow-private-hosts",
        help="Also fetch URLs that resolve to loopback, private or link-local addresses (off: refused).", rich_help_panel="Download")] = False,
    retries: Annotated[int, typer.Option(help="Extra attempts per failed download.", rich_help_panel="Download")] = 0,
    shard_size: Annotated[int, typer.Option(help="Input rows per tar shard.", rich_help_panel="Input and output")] = 10_000,
    url_column: Annotated[Optional[str], typer.Option(help="URL column (default: URL or url).", rich_help_panel="Input and output")] = None,
    caption_column: Annotated[
        Optional[str], typer.Option(help="Caption column (default: TEXT, caption or text).", rich_help_panel="Input and output")
    ] = None,
    respect_optout: Annotated[
        bool, typer.Option(help="Skip images whose X-Robots-Tag says noai/noimageai/noindex/noimageindex.", rich_help_panel="Download")
    ] = True,
    keep: Annotated[Optional[str], typer.Option(
        help="A parquet file or folder with a `key` column, and `shard` to tell keys that repeat across shards apart "
        "(dedup's keep.parquet, filter's output): INPUTS are then existing shard folders "
        "(pack's, img2dataset's, WebDataset), and each shard is rewritten with only the kept samples, nothing "
        "downloaded again.", rich_help_panel="Input and output")] = None,
    allow_incomplete: AllowIncompleteOption = False,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Write into --output even if it holds another stage's outputs (e.g. latents); "
        "files of the same name are replaced.", rich_help_panel="Input and output")] = False,
    storage_options: StorageOption = None,
    rank: RankOption = None,
    world_size: WorldSizeOption = None,
    quiet: QuietOption = False,
) -> None:
    """Download the URLs of parquet rows with img2dataset into WebDataset shards (`key.jpg/.txt/.json`),
    keeping every input column in each sample's json; writes DIR/manifest.json.

    Examples:

    ```
    laionkit pack filtered/ --output shards/

    laionkit pack laion2B-en-part-00000.parquet --output shards/ --image-size 256 \\
        --resize-mode keep_ratio

    laionkit pack out/shards --keep out/kept --output out/kept-shards   # only the kept samples, no download
    ```
    """

    from laionkit.pack import PackConfig, run

    config = PackConfig(
        inputs=tuple(inputs), output=output, image_size=image_size, resize_mode=resize_mode,
        min_image_size=min_image_size, max_aspect_ratio=max_aspect_ratio, max_image_area=max_image_area,
        encode_format=encode_format, encode_quality=encode_quality, processes=processes or available_cpus(),
        threads=threads, timeout=timeout, max_bytes=max_bytes, allow_private_hosts=allow_private_hosts,
        retries=retries, shard_size=shard_size, url_column=url_column,
        caption_column=caption_column, respect_optout=respect_optout, rank=rank, world_size=world_size,
        quiet=quiet, storage_options=storage_options, overwrite=overwrite, keep=keep, allow_incomplete=allow_incomplete,
    )
    if CONFIG_ONLY.get():
        return
    manifest = run(config)
    if not quiet:
        typer.echo(
            f"{output}: {len(manifest['shards'])}/{manifest['planned_shards']} shards, "
            f"{manifest['samples']:,} samples of {manifest['rows']:,} rows ({manifest['success_rate']:.1%})"
        )


@app.command("score", epilog="""More examples:

    laionkit score 'out/shards/{00000..00099}.tar' --output out/scored --score anime="prompt:an anime drawing|a manga page"

    torchrun --nproc-per-node 8 -m laionkit.cli score s3://bucket/shards --output s3://bucket/scored --batch-size 512   # one rank per GPU

    laionkit filter out/shards --scores out/scored --where "aesthetic >= 5 AND pwatermark < 0.5" --output out/kept   # join by key

    laionkit filter out/scored/scores --embeddings out/scored/img_emb --score aes1=aesthetic-v1:sa_0_4_vit_l_14_linear.pth --output out/aes1

    laionkit score captioned/ --captions alt,vlm --output scored   # similarity_alt, similarity_vlm: encode --caption-scores scored

    laionkit score out/shards --output out/scored --batch-size 512 --decode draft-device   # few CPU cores per GPU: resize on it
""")
def score(
    shards: Annotated[list[str], typer.Argument(help="pack's / img2dataset's shard folder(s), tar files, globs or {a..b} "
                                                "patterns (paths or URLs); plain WebDataset tars too.")],
    output: Annotated[str, typer.Option("--output", "-o", help="Output folder (a path or URL): scores/, img_emb/, "
                                        "records/, stats.json (docs/FORMATS.md section 6).", rich_help_panel="Input and output")],
    clip_model: Annotated[str, typer.Option(help="open_clip model: a name (ViT-L-14), hf-hub:ORG/REPO or a model "
                                            "config .json.", rich_help_panel="Model")] = "ViT-L-14",
    clip_pretrained: Annotated[str, typer.Option(help="open_clip weights: a tag (openai) or a weights file "
                                                 "(.safetensors, .pt); 'none' = random init.", rich_help_panel="Model")] = "openai",
    score_spec: Annotated[Optional[list[str]], typer.Option(
        "--score", help="NAME=KIND:ARG as filter's: aesthetic-v2, aesthetic-v1, head (a weights path) or prompt "
        "(text, a|b); computed from the stored embeddings; repeatable.", rich_help_panel="Model")] = None,
    watermark: Annotated[Optional[str], typer.Option(
        help="LAION's watermark detector weights (watermark_model_v1.pt or .safetensors): adds pwatermark.", rich_help_panel="Model")] = None,
    nsfw: Annotated[Optional[str], typer.Option(
        help="LAION's CLIP NSFW head weights (norm.mean/variance, linear_1..4; .safetensors or .pt): adds punsafe.", rich_help_panel="Model")] = None,
    batch_size: Annotated[int, typer.Option(help="Images per device batch.", rich_help_panel="Performance")] = 256,
    workers: Annotated[int, typer.Option(help="DataLoader worker processes that decode (each reads whole shards).", rich_help_panel="Performance")] = 4,
    dtype: Annotated[str, typer.Option(help="auto (bf16 on CUDA: CLIP in bf16 weights; fp32 on CPU), fp32, fp16, "
                                           "bf16.", rich_help_panel="Performance")] = "auto",
    device: Annotated[Optional[str], typer.Option(help="torch device (default: cuda:LOCAL_RANK, else cpu).", rich_help_panel="Performance")] = None,
    cuda_graphs: Annotated[bool, typer.Option(
        "--cuda-graphs", help="Replay CLIP's image and caption forwards from CUDA graphs (one launch a batch): for "
        "hosts whose cores are busy decoding. Same values; not yet the default (docs/BENCHMARKS.md, score).", rich_help_panel="Performance")] = False,
    compile: Annotated[bool, typer.Option(
        "--compile", help="torch.compile CLIP's image forward for full batches (one graph; a shard's first, "
        "smaller batches and its last one eager). "
        "Values within rounding of eager's; for ViT-L/14 no faster than eager (docs/BENCHMARKS.md, score).", rich_help_panel="Performance")] = False,
    decode: Annotated[str, typer.Option(
        help="exact: full-size decode (pHash = imagehash's, CLIP input = open_clip's preprocess of the file); draft: "
        "JPEGs decoded at a reduced DCT scale that keeps the short side >= the models' input: several times less "
        "CPU per large JPEG, values slightly different; device: workers only read and hash, baseline JPEGs are "
        "decoded and resized on the device (nvJPEG on CUDA) for hosts with few CPU cores per GPU, values slightly "
        "different; draft-device: workers decode as draft does, the device resizes and hashes (about half of "
        "draft's CPU time per image moves to the GPU).", rich_help_panel="Performance")] = "exact",
    caption_key: Annotated[Optional[str], typer.Option(
        help="Where captions are (a member or a json key); default: .txt, .caption, json caption / text / TEXT.", rich_help_panel="Input and output")] = None,
    captions: Annotated[Optional[str], typer.Option(
        help="Comma-separated caption names as encode --captions takes them: alt (the alt-text) and json captions keys "
        "(`laionkit caption`'s): a similarity_NAME column each (null where the sample lacks it), for encode "
        "--caption-scores.", rich_help_panel="Input and output")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Redo shards scored with other settings; also write into another stage's folder.", rich_help_panel="Input and output")] = False,
    storage_options: StorageOption = None,
    rank: RankOption = None,
    world_size: WorldSizeOption = None,
    quiet: QuietOption = False,
    allow_incomplete: AllowIncompleteOption = False,
) -> None:
    """Decode each image once and write per sample: key, source row, size, sha256, pHash, CLIP embedding
    (float16 npy, LAION's embeddings layout), caption similarity, pwatermark, punsafe and --score columns;
    rank-sharded and resumable per shard.

    Examples:

    ```
    laionkit score out/shards --output out/scored \\
        --score aesthetic=aesthetic-v2:sac+logos+ava1-l14-linearMSE.pth \\
        --watermark watermark_model_v1.pt --nsfw clip_l14_nsfw_head.safetensors

    laionkit score out/shards --output out/scored --batch-size 512 --decode draft   # less CPU per JPEG, values slightly different

    laionkit models tiny-eval --output m && laionkit score out/shards --output s \\
        --clip-model m/tiny-clip.json --clip-pretrained m/tiny-clip.safetensors   # offline
    ```
    """
    from laionkit.score import ScoreConfig, run

    config = ScoreConfig(
        shards=tuple(shards), output=output, clip_model=clip_model,
        clip_pretrained=None if clip_pretrained.lower() == "none" else clip_pretrained, scores=tuple(score_spec or ()),
        watermark=watermark, nsfw=nsfw, batch_size=batch_size, workers=workers, dtype=dtype, device=device,
        cuda_graphs=cuda_graphs, compile=compile, decode=decode, caption_key=caption_key, captions=captions, rank=rank,
        world_size=world_size, overwrite=overwrite, quiet=quiet, allow_incomplete=allow_incomplete,
        storage_options=storage_options,
    )
    if CONFIG_ONLY.get():
        return
    summary = run(config, log=lambda line: err_console.print(line, highlight=False))
    if not quiet:
        err_console.print(f"scored {summary['samples_out']} samples ({summary['skipped']} skipped) from "
                          f"{summary['shards']} shards into {output}", highlight=False)


# A failed CUDA context ("sticky" errors: every later CUDA call fails too). Seen on an H200: after a cuBLAS
# failure the traceback was printed, then the process never exited (interpreter teardown frees CUDA memory
# and joins loader threads) until its launcher killed it minutes later.


@app.command("dedup", epilog="""More examples:

    laionkit dedup scored/ --keep out/kept --keep-by aesthetic --output out/dedup   # only the rows filter kept

    torchrun --nproc-per-node 8 -m laionkit.cli dedup scored/ --output out/dedup   # 8 ranks, no coordinator

    laionkit dedup s3://bucket/scored --output s3://bucket/dedup --scratch /nvme/dedup   # a bucket, worked on local disk

out/dedup/keep.parquet holds the kept rows' key, shard and input folder (a `--keep` list); removed.parquet says why each
other row went. Rerun the same command after a crash: finished steps are kept.
""")
def dedup_command(
    inputs: Annotated[list[str], typer.Argument(help="`laionkit score` output folders (`scores/*.parquet`, `img_emb/*.npy`).")],
    output: Annotated[str, typer.Option("--output", "-o", help="Folder for keep.parquet, removed.parquet, stats.json.", rich_help_panel="Input and output")],
    layers: Annotated[str, typer.Option(
        help="Comma-separated layers, applied in the order exact, phash, semantic.", rich_help_panel="Layers")] = "exact,phash,semantic",
    phash_distance: Annotated[int, typer.Option(help="pHash Hamming distance (bits) within which two images are duplicates.", rich_help_panel="Layers")] = 4,
    phash_bands: Annotated[int, typer.Option(
        help="LSH bands of the 64 pHash bits; 0 = distance + 1, which finds every pair within the distance "
        "(fewer, wider bands: fewer candidate pairs to check, some pairs missed).", rich_help_panel="Layers")] = 0,
    epsilon: Annotated[float, typer.Option(
        help="semantic and --against: CLIP cosine similarity >= 1 - epsilon is a duplicate.", rich_help_panel="Layers")] = 0.05,
    clusters: Annotated[int, typer.Option(help="k-means clusters of the semantic layer; 0 = one per 10,000 rows.", rich_help_panel="Layers")] = 0,
    kmeans_iterations: Annotated[int, typer.Option(help="k-means iterations.", rich_help_panel="Layers")] = 20,
    clusters_per_row: Annotated[int, typer.Option(
        help="semantic: search each row's pairs in its N nearest clusters (SemDeDup: 1). 2 also finds the "
        "duplicates k-means split between clusters, at twice the pair search.", rich_help_panel="Layers")] = 1,
    seed: Annotated[int, typer.Option(help="k-means seed.", rich_help_panel="Layers")] = 0,
    keep_by: Annotated[Optional[str], typer.Option(
        help="Score column: each group keeps its row with the highest value (ties: smallest key, shard).", rich_help_panel="Layers")] = None,
    against: Annotated[Optional[list[str]], typer.Option(
        "--against", help="Reference `laionkit score` folder (an evaluation set): drop rows within a layer's "
        "distance of any reference row; repeatable.", rich_help_panel="Layers")] = None,
    keep: Annotated[Optional[str], typer.Option(
        "--keep", help="Parquet file or folder with a `key` column (filter's output): dedup only these rows, so "
        "each duplicate group keeps its best row among those the filter kept.", rich_help_panel="Input and output")] = None,
    allow_incomplete: AllowIncompleteOption = False,
    bucket_rows: Annotated[int, typer.Option(
        help="Rows per hash bucket / cluster partition: what one rank holds in memory at a time.", rich_help_panel="Distribution")] = 4_000_000,
    wait: Annotated[float, typer.Option(help="Seconds a rank waits for the other ranks' outputs of a step.", rich_help_panel="Distribution")] = 3600.0,
    threads: Annotated[Optional[int], typer.Option(help="DuckDB / faiss threads (default: the CPUs this rank may use).", rich_help_panel="Distribution")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace the outputs of a run with other inputs or settings.", rich_help_panel="Input and output")] = False,
    scratch: Annotated[Optional[str], typer.Option(
        help="With URL inputs or --output: the local folder remote inputs are mirrored to and the steps run in "
        "(ranks on several nodes: a folder they all see). Default: laionkit-dedup in $LAIONKIT_STAGING or the "
        "temp folder.", rich_help_panel="Input and output")] = None,
    rank: RankOption = None,
    world_size: WorldSizeOption = None,
    quiet: QuietOption = False,
) -> None:
    """Remove duplicate images in layers (exact sha256, pHash, SemDeDup) and near-evaluation-set images.

    Examples:

    ```
    laionkit dedup scored/ --output out/dedup --keep-by aesthetic   # exact, pHash and semantic layers

    laionkit dedup scored/ --layers exact,phash --phash-distance 6 --output out/dedup   # no embeddings needed

    laionkit dedup scored/ --against coco-val-scored/ --epsilon 0.05 --output out/dedup   # and drop eval-set look-alikes
    ```
    """
    from laionkit import dedup

    config = dedup.DedupConfig(
        inputs=tuple(inputs), output=output, layers=tuple(x.strip() for x in layers.split(",") if x.strip()),
        phash_distance=phash_distance, phash_bands=phash_bands, epsilon=epsilon, clusters=clusters,
        kmeans_iterations=kmeans_iterations, clusters_per_row=clusters_per_row, seed=seed, keep_by=keep_by, against=tuple(against or ()), keep=keep,
        bucket_rows=bucket_rows, wait=wait, threads=threads, overwrite=overwrite, scratch=scratch, rank=rank,
        world_size=world_size, quiet=quiet, allow_incomplete=allow_incomplete,
    )
    if CONFIG_ONLY.get():
        return
    stats = dedup.run(config)
    if not quiet and "kept" in stats:
        removed = ", ".join(f"{layer} {n:,}" for layer, n in stats["removed"].items())
        outside = f", {stats['not_in_keep']:,} not in --keep" if stats.get("keep") else ""
        err_console.print(f"dedup: kept {stats['kept']:,} of {stats['rows_in']:,} rows (removed: {removed}{outside}) "
                          f"-> {output}")


@app.command("caption", epilog="""More examples:

    torchrun --nproc-per-node 8 -m laionkit.cli caption data/shards --model Qwen/Qwen2-VL-2B-Instruct --batch-size 64 --output data/captioned   # one rank per GPU

    laionkit caption data/shards --model Qwen/Qwen2-VL-2B-Instruct --backend vllm --output data/captioned   # where vllm is installed

Each sample is copied whole (image, txt alt-text, json) with json["captions"][NAME] added; the output folder
reads as pack's, so `laionkit encode` takes it. Rerun the same command after a crash: finished shards are kept.
""")
def caption_command(**options) -> None:
    """Caption image shards with a vision-language model (transformers' AutoModelForImageTextToText, greedy),
    writing new shards whose json holds each caption beside the alt-text; rank-sharded, resumable per shard.

    Examples:

    ```
    laionkit caption data/shards --model Qwen/Qwen2-VL-2B-Instruct --output data/captioned

    laionkit caption data/shards --model Qwen/Qwen2.5-VL-3B-Instruct --name qwen \\
        --prompt "Describe this image in one sentence." --max-new-tokens 77 \\
        --output data/captioned

    laionkit models tiny-vlm --output models/vlm && laionkit caption data/shards \\
        --model models/vlm --output out --max-new-tokens 8
    ```
    """
    from laionkit.caption import run

    config = CaptionConfig(**options)
    if CONFIG_ONLY.get():
        return
    summary = run(config, log=lambda line: err_console.print(line, highlight=False))
    if not options["quiet"]:
        err_console.print(f"captioned {summary['captioned']} samples ({summary['skipped']} skipped, "
                          f"{summary['empty_captions']} empty) from {summary['shards']} shards into "
                          f"{options['output']}", highlight=False)


# caption's options are CaptionConfig's fields (laionkit/common/options.py).
caption_command.__signature__ = inspect.Signature(typer_parameters(CaptionConfig))


@app.command(epilog="""More examples:

    laionkit encode 'data/shards/{00000..00999}.tar' --model sd2 --buckets --compile --output data/latents

    laionkit encode data/shards --model flux-dev --resolution 1024 --buckets --output data/latents-flux

    laionkit encode data/shards --model flux-dev --resolution 512 --max-sequence-length 128 --output lat   # short captions

    accelerate launch -m laionkit.cli encode data/shards --model sd15 --output data/latents   # one rank per GPU

    laionkit encode s3://bucket/shards --model sd15 --output s3://bucket/latents   # AWS_* credentials / AWS_ENDPOINT_URL

    laionkit encode i2d-parquet/ --model sd15 --output lat --caption-key TEXT   # img2dataset parquet (or files) output

    laionkit encode out/shards --keep out/kept --model sd15 --output lat   # only the keys filter kept (e.g. by score)
    laionkit encode captioned/ --model sd3-medium --captions alt,vlm --output lat   # alt-text and `laionkit caption`'s vlm

    laionkit score captioned/ --captions alt,vlm --output scored && laionkit encode captioned/ --model sd3-medium --captions alt,vlm --caption-scores scored --output lat   # then train --caption-mix clip
""")
def encode(
    shards: Annotated[list[str], typer.Argument(help="pack's shard folder(s), tar files, globs or {a..b} patterns; img2dataset's parquet and files output formats too.")],
    output: Annotated[str, typer.Option("--output", "-o", help="Output folder (a path or URL): one latent tar per input tar.", rich_help_panel="Input and output")],
    model: Annotated[str, typer.Option(help="Preset (sd15, sd2, sdxl, sd3-medium, flux-dev, pixart-sigma-xl, sana-1600m, sana-600m, z-image, z-image-turbo, qwen-image, flux2-klein-4b, flux2-klein-9b, flux2-dev), diffusers folder or hub id for all components; its model_index.json decides the family (sd, sdxl, sd3, flux, pixart, sana, z-image, qwen-image, flux2 or flux2-dev), recorded in the manifest.", rich_help_panel="Model")] = "sd15",
    vae: Annotated[Optional[str], typer.Option(help="VAE source (default: --model).", rich_help_panel="Model")] = None,
    text_encoder: Annotated[Optional[str], typer.Option(help="Text encoder source (default: --model).", rich_help_panel="Model")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(help="Tokenizer source (default: --model).", rich_help_panel="Model")] = None,
    text_layer: Annotated[Optional[str], typer.Option(help="last or penultimate hidden state (default: the preset's, else last).", rich_help_panel="Model")] = None,
    resolution: Annotated[int, typer.Option(help="Square side in pixels, or the bucket area's side with --buckets.", rich_help_panel="Images")] = 512,
    buckets: Annotated[bool, typer.Option(help="Aspect-ratio buckets of equal pixel area instead of square crops.", rich_help_panel="Images")] = False,
    batch_size: Annotated[int, typer.Option(help="Images per GPU batch.", rich_help_panel="Performance")] = 32,
    workers: Annotated[int, typer.Option(help="DataLoader worker processes (each reads whole shards).", rich_help_panel="Performance")] = 4,
    decode: Annotated[str, typer.Option(help="Where JPEGs are decoded: cpu (workers), gpu (nvjpeg) or auto (gpu if CUDA and --workers < 4).", rich_help_panel="Performance")] = "auto",
    dtype: Annotated[str, typer.Option(help="Encoder compute dtype: auto (bf16 on GPU, fp32 on CPU), fp32, fp16, bf16.", rich_help_panel="Performance")] = "auto",
    compile: Annotated[bool, typer.Option(help="torch.compile the encoders (one shape per graph).", rich_help_panel="Performance")] = False,
    device: Annotated[Optional[str], typer.Option(help="torch device (default: cuda:LOCAL_RANK, else cpu).", rich_help_panel="Performance")] = None,
    text: Annotated[Optional[str], typer.Option(help="stored: the text encoders' outputs per sample; online (sd3, flux, pixart, sana): token ids only, train runs the frozen text encoders. Default: the family's (online for flux, stored for the others; docs/BENCHMARKS.md).", rich_help_panel="Captions")] = None,
    caption_key: Annotated[Optional[str], typer.Option(help="Where captions are: a member (txt, caption) or a json key (e.g. TEXT). Default: the first non-empty of .txt, .caption, json caption, text, TEXT.", rich_help_panel="Captions")] = None,
    keep: Annotated[Optional[str], typer.Option(help="A parquet file or folder with a `key` column, and `shard` to tell keys that repeat across shards apart (dedup's keep.parquet, filter's output, e.g. after `filter --scores`): encode only those samples of the shards, nothing downloaded again; the others are counted as not_kept.", rich_help_panel="Input and output")] = None,
    captions: Annotated[Optional[str], typer.Option(help="Several captions per sample, comma-separated names: alt (the alt-text, as found without this flag) and any key of the image json's captions (what `laionkit caption` writes), e.g. alt,vlm. Each one's text states (or token ids) are stored; train --caption-mix picks one per sample and step. A sample lacking a named caption stores the others (recorded); one lacking all is skipped.", rich_help_panel="Captions")] = None,
    max_sequence_length: Annotated[Optional[int], typer.Option(help="The caption window in tokens, as the pipelines' max_sequence_length keyword (default: theirs: flux 512, sd3's T5 256, pixart and sana 300, z-image, qwen-image and flux2 512; sd and sdxl keep CLIP's 77). Shorter captions cost less to train (Flux, SD3 and FLUX.2 attend to every padding token); generate with the same max_sequence_length. Recorded in the manifest.", rich_help_panel="Captions")] = None,
    caption_scores: Annotated[Optional[str], typer.Option(help="`laionkit score --captions NAMES` output folder: each --captions name's CLIP score is its similarity_NAME column, joined by shard and key, for train --caption-mix clip. Then the only source of scores: json caption_scores are ignored (docs/FORMATS.md section 3).", rich_help_panel="Captions")] = None,
    allow_incomplete: AllowIncompleteOption = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Write into --output even if it holds another stage's outputs (e.g. image shards); same names are replaced.", rich_help_panel="Input and output")] = False,
    storage_options: StorageOption = None,
    rank: RankOption = None,
    world_size: WorldSizeOption = None,
    quiet: QuietOption = False,
) -> None:
    """Encode pack's image shards into VAE posterior moments + text-encoder hidden states (float16), one
    latent shard per image shard, resumable and rank-sharded; see docs/FORMATS.md section 3.

    Examples:

    ```
    laionkit encode data/shards --model sd15 --output data/latents --resolution 512

    laionkit encode data/shards --model sdxl --resolution 1024 --output data/latents-sdxl

    laionkit models tiny --output models/tiny && laionkit encode data/shards --model models/tiny \\
        --output lat --resolution 64
    ```
    """
    from laionkit import encode as encode_stage

    config = encode_stage.EncodeConfig(
        shards=tuple(shards), output=output, model=model, vae=vae, text_encoder=text_encoder,
        tokenizer=tokenizer, text_layer=text_layer, resolution=resolution, buckets=buckets,
        batch_size=batch_size, workers=workers, decode=decode, dtype=dtype, compile=compile, device=device,
        rank=rank, world_size=world_size, quiet=quiet, storage_options=storage_options, text=text,
        caption_key=caption_key, captions=captions, overwrite=overwrite, keep=keep, caption_scores=caption_scores,
        max_sequence_length=max_sequence_length, allow_incomplete=allow_incomplete,
    )
    if CONFIG_ONLY.get():
        return
    summary = encode_stage.run(config, log=lambda line: err_console.print(line, highlight=False))
    if not quiet:
        err_console.print(f"encoded {summary['samples_out']} samples ({summary['skipped']} skipped, "
                          f"{summary['empty_captions']} with an empty caption) "
                          f"from {summary['shards']} shards into {output}", highlight=False)


@app.command("stats")
def stats_command(
    folder: Annotated[str, typer.Argument(help="An output folder of a laionkit stage (a path or URL).")],
    storage_options: StorageOption = None,
) -> None:
    """Print a readable summary of a stage's output folder, merged across ranks.

    Examples:

    ```
    laionkit stats out/filtered   # a filter folder: rows in/out per rank, drops and nulls per rule

    laionkit stats out/shards   # pack or plain img2dataset output; plain WebDataset tars too (read-only)

    laionkit stats out/deduped   # dedup: rows removed by each layer, kept; a train run: steps, loss, checkpoints
    ```

    More: `laionkit stats s3://bucket/shards` reads any fsspec URL (credentials from AWS_* / --storage-options).
    """
    from laionkit import stats as stats_stage

    stats_stage.run(stats_stage.StatsConfig(folder=folder, storage_options=storage_options))
