"""Checks train makes before it trusts an input it did not write: one line naming what does not fit.

* online-text latents: the text encoders (and tokenizers) train loads must be the ones encode hashed into
  the manifest's ``models``, else the stored token ids are encoded by another model without a word;
* a pretrained ``--unet`` / ``--transformer`` (or a config file) must be the latents' family's denoiser
  class, checked on its config before diffusers loads weights into the wrong class (a shape error deep
  in from_pretrained otherwise);
* ``--train-guidance`` needs a denoiser with a guidance embedding (it was dropped silently);
* a latent folder in a bucket that other tools uploaded (``aws s3 sync``: no done records) counts all its
  objects (docs/FORMATS.md §5), as the storage listings do.
"""

from __future__ import annotations

from laionkit.common import LaionkitError
from laionkit.common.storage import DONE_SUFFIX, Location, _errors


def uploaded_without_records(folder: Location) -> bool:
    """A folder in an object store that holds no done record: uploaded by other tools, every object counts."""
    if folder.local:
        return False
    with _errors("cannot list", folder):
        try:
            names = folder.fs.ls(folder.path, detail=False, refresh=True)
        except FileNotFoundError:
            return False
    names = [str(name).rstrip("/").rsplit("/", 1)[-1] for name in names]
    return bool(names) and not any(n.startswith(".") and n.endswith(DONE_SUFFIX) for n in names)


def check_text_encoders(family, models: dict, allow: bool, say=print) -> None:
    """Each text encoder and tokenizer of online-text latents is the one encode used: the sha256 of its
    files as now found equals the manifest's (a component encode could not hash is not compared)."""
    from laionkit.common.models import fingerprint

    for pair in family.text_encoders:
        for component in reversed(pair):  # the encoder first: the one that turns ids into states
            recorded = (models.get(component) or {}).get("files")
            if not recorded:
                continue
            source = models[component]["source"]
            found = fingerprint(source, component).get("files") or {}
            changed = sorted(name for name in set(recorded) | set(found) if recorded.get(name) != found.get(name))
            if not changed:
                continue
            message = (f"online-text latents: {component} from {source} is not the one encode used (its "
                       f"{', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''} differ from the manifest's "
                       "sha256), so the stored token ids would be encoded by another model")
            if not allow:
                raise LaionkitError(f"{message}: restore it or re-encode, or give --allow-changed-text-encoder "
                                    "to train with it anyway")
            say(f"warning: {message} (--allow-changed-text-encoder)")


def check_denoiser_class(found: str | None, spec, flag: str, source: str) -> None:
    """A model config's ``_class_name`` against the class the latents' family trains."""
    from laionkit.families import families, get_family

    if not found or found == spec.denoiser_class:
        return
    owners = [name for name in families() if get_family(name).denoiser_class == found]
    whose = f" (a {'/'.join(owners)} model)" if owners else ""
    raise LaionkitError(f"{flag} {source}: its config names {found}{whose}; these {spec.name} latents train "
                        f"a {spec.denoiser_class}")


def check_denoiser_folder(source: str, spec, flag: str) -> None:
    """check_denoiser_class on a pretrained model's config (read alone, before any weights)."""
    import diffusers

    from laionkit.common.models import _load_config

    config = _load_config(getattr(diffusers, spec.denoiser_class), spec.presets.get(source, source),
                          spec.denoiser_subfolder)
    check_denoiser_class(config.get("_class_name"), spec, flag, source)


def check_guidance(config, spec, model) -> None:
    """--train-guidance feeds a guidance embedding: refused where the denoiser has none."""
    if config.train_guidance is not None and not getattr(model.config, "guidance_embeds", False):
        raise LaionkitError(f"--train-guidance {config.train_guidance}: this {spec.name} {spec.denoiser_class} has "
                            "no guidance embedding (its config's guidance_embeds is not true); leave the flag out")
