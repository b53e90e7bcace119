"""The Medical Segmentation Decathlon's task folders (layout ``decathlon``), for ``model=unet3d``.

A task folder, as the Decathlon's tarballs unpack (``Task03_Liver``: LiTS's volumes as most users download them),
holds ``imagesTr/`` (the training volumes, ``liver_N.nii.gz``), ``labelsTr/`` (their labels, under the same
names), ``imagesTs/`` (test volumes without labels) and ``dataset.json`` (the task's name, its modality, its classes
by label, the training pairs and the test volumes). The tarballs also carry macOS's ``._NAME`` resource forks beside
every file: hidden names, left out as every hidden file is.

gems reads it as it reads LiTS's volumes (gems.data.layouts.nifti: tiles of the model's edge, the CT window, labels
lined up onto their volume's grid by their affines): each volume's labels are the file of its name in
``labelsTr/``; the classes' names are ``dataset.json``'s (the Dice columns of the record, the table and ``gems
eval``); ``imagesTs/`` has no labels to train or validate on and is left out, which the run says. The volumes come
gzip-compressed, which cannot be read by position: ``gems data convert`` writes the task uncompressed into
``data.out`` (``imagesTr/``, ``labelsTr/`` and ``dataset.json``), which gems reads where it lies. Tasks of several
channels a voxel (BrainTumour's four MR sequences, 4D files) are refused naming the file: the reader takes one.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, ClassVar, Iterable, Sequence

import numpy as np

from gems.data.layouts import listing, register
from gems.data.layouts.nifti import NiftiLayout, missing_labels, uncompressed
from gems.errors import ConfigError
from gems.paths import commit

IMAGES, LABELS, TEST, MANIFEST = "imagesTr", "labelsTr", "imagesTs", "dataset.json"
_NII = re.compile(r"^[^.].*\.nii(\.gz)?$")


def _task(path: str | os.PathLike) -> Path:
    """The task folder of ``path``: the folder itself, or the one a training volume (``imagesTr/NAME``) lies in."""
    p = Path(path)
    return p.parent.parent if p.is_file() else p


def manifest(path: str | os.PathLike, key: str = "data.path") -> dict[str, Any] | None:
    """The task's ``dataset.json`` (None where there is none); one that is no JSON object is bad input naming it."""
    f = _task(path) / MANIFEST
    if not f.is_file():
        return None
    try:
        got = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(key, str(path), f"a dataset.json that is JSON, as the Decathlon ships it; {f.name} is not "
                          f"({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(got, dict):
        raise ConfigError(key, str(path), "a dataset.json holding an object (its labels, training and test lists)")
    return got


def labels_of(task: dict[str, Any] | None, key: str, path: str | os.PathLike) -> list[str] | None:
    """The classes' names by label, from ``dataset.json``'s ``labels`` ({"0": "background", "1": "liver", ...}),
    which must number them 0 .. n-1; None without one."""
    if task is None or "labels" not in task:
        return None
    raw = task["labels"]
    try:
        names = {int(k): str(v) for k, v in dict(raw).items()}
    except (TypeError, ValueError):
        raise ConfigError(key, str(path), f"dataset.json's labels as {{\"0\": \"background\", \"1\": ...}}; it holds "
                          f"{str(raw)[:120]}") from None
    if sorted(names) != list(range(len(names))):
        raise ConfigError(key, str(path), f"dataset.json's labels numbered 0 .. n-1; it numbers {sorted(names)}")
    return [names[k] for k in range(len(names))]


@register
class DecathlonLayout(NiftiLayout):
    name: ClassVar[str] = "decathlon"
    about: ClassVar[str] = ("the Medical Segmentation Decathlon's task folders: imagesTr/ and labelsTr/ of NIfTI "
                            "volumes (.nii.gz through gems data convert) and dataset.json, for model=unet3d")
    labels_where: ClassVar[str] = "the Decathlon's: labelsTr/NAME for imagesTr/NAME"

    def files(self, path: str | os.PathLike) -> list[Path]:
        """The training volumes of the task folder at ``path`` (``imagesTr/``; not its labels, not ``imagesTs/``),
        by name."""
        p = Path(path)
        if p.is_file():  # one volume of a task (gems data check reads it alone)
            return [p] if p.parent.name == IMAGES and _NII.match(p.name) else []
        images = p / IMAGES
        if not (images.is_dir() and (p / LABELS).is_dir()):
            return []
        return [images / n for n in listing(images) if _NII.match(n)]

    def companions(self, file: Path) -> list[Path]:
        return [file.parent.parent / LABELS / file.name]

    def holds(self, files: Sequence[Path]) -> bool:
        return bool(files) and all(f.parent.name == IMAGES for f in files)

    def folder_files(self, path: str | os.PathLike) -> list[Path]:
        """The task's ``dataset.json`` (copied where the run stages its files; it names the classes)."""
        f = _task(path) / MANIFEST
        return [f] if f.is_file() else []

    def class_names(self, path: str | os.PathLike) -> list[str] | None:
        return labels_of(manifest(path), "data.path", path)

    def folder_notes(self, path: str | os.PathLike, key: str) -> list[str]:
        test = _task(path) / TEST
        n = len([f for f in listing(test) if _NII.match(f)]) if test.is_dir() else 0
        task = manifest(path, key) or {}
        said = f" ({task['name']})" if isinstance(task.get("name"), str) else ""
        return [f"{key}: the Decathlon task{said}: {TEST}/ ({n} volumes without labels) left out"] if n else []

    def converted_name(self, source: Path, tile: int | None = None) -> str:
        if tile:
            return super().converted_name(source, tile)
        return f"{IMAGES}/{source.name[:-3] if source.name.endswith('.gz') else source.name}"

    def convert(self, source: Path, folder: Path, channels: int | None = None, key: str = "data.path",
                tile: int | None = None) -> Path:
        """A training volume and its labels written uncompressed into the task folder ``folder`` (``imagesTr/``,
        ``labelsTr/``; ``dataset.json`` beside them, once), or with ``tile`` one case of the tiled layout (its
        classes dataset.json's); returns the volume's path (written last: once it is there, so are its labels)."""
        if tile:
            return super().convert(source, folder, channels, key, tile)
        lab = self.companions(source)[0]
        if not lab.is_file():
            raise missing_labels(source, lab, key, self.labels_where)
        task = source.parent.parent
        if (task / MANIFEST).is_file() and not (folder / MANIFEST).is_file():
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{MANIFEST}.{os.getpid()}.tmp"
            shutil.copyfile(task / MANIFEST, tmp)
            commit(tmp, folder / MANIFEST)
        out = {}
        for kind, src in ((LABELS, lab), (IMAGES, source)):
            (folder / kind).mkdir(parents=True, exist_ok=True)
            dst = folder / kind / (src.name[:-3] if src.name.endswith(".gz") else src.name)
            uncompressed(src, dst, key)
            out[kind] = dst
        return out[IMAGES]

    def write(self, folder: str | os.PathLike, samples: Iterable[tuple[np.ndarray, np.ndarray]],
              name: str = "liver_{}", compress: bool = True, spacing: Sequence[float] = (0.8, 0.8, 1.5), *,
              sync: bool = False, classes: Sequence[str] = ("background", "liver", "cancer"),
              test: int = 1) -> list[Path]:
        """A task folder as the Decathlon ships it, through nibabel: ``imagesTr/liver_N.nii.gz`` (int16, HU) and
        ``labelsTr/liver_N.nii.gz`` (uint8) from (voxels, labels) pairs, ``test`` volumes more in ``imagesTs/``
        (the last pairs' voxels, no labels), macOS's ``._`` forks beside each and ``dataset.json`` (its classes
        ``classes``, the training pairs and the test volumes, with the Decathlon's ``./`` paths); returns the
        training volumes' paths."""
        import nibabel as nib

        out = Path(folder)
        pairs = [(np.asarray(v).reshape(np.asarray(v).shape[-3:]), np.asarray(g)) for v, g in samples]
        if len(pairs) <= test:
            raise ValueError(f"more pairs than the {test} test volume(s)")
        affine = np.diag([*(float(s) for s in spacing), 1.0])
        ext = ".nii.gz" if compress else ".nii"
        training, testing, files = [], [], []
        for i, (vol, lab) in enumerate(pairs):
            kinds: list[tuple[str, np.ndarray, Any]] = [(IMAGES if i < len(pairs) - test else TEST, vol, np.int16)]
            if i < len(pairs) - test:
                kinds.append((LABELS, lab, np.uint8))
            for kind, arr, dt in kinds:
                (out / kind).mkdir(parents=True, exist_ok=True)
                final = out / kind / f"{name.format(i)}{ext}"
                tmp = final.with_name(f".{final.name}.tmp{ext}")
                img = nib.Nifti1Image(np.asarray(arr, dtype=dt).T, affine)  # (z, y, x) in C order: (x, y, z) in F
                img.header.set_xyzt_units("mm")
                nib.save(img, str(tmp))
                commit(tmp, final, sync)
                (final.parent / f"._{final.name}").write_bytes(b"\x00\x05\x16\x07" + bytes(60))  # a macOS fork
            if i < len(pairs) - test:
                training.append({"image": f"./{IMAGES}/{name.format(i)}{ext}", "label": f"./{LABELS}/{name.format(i)}{ext}"})
                files.append(out / IMAGES / f"{name.format(i)}{ext}")
            else:
                testing.append(f"./{TEST}/{name.format(i)}{ext}")
        (out / MANIFEST).write_text(json.dumps({
            "name": "Liver", "description": "written by gems for its tests, as the Decathlon's", "modality": {"0": "CT"},
            "labels": {str(k): c for k, c in enumerate(classes)}, "numTraining": len(training),
            "numTest": len(testing), "training": training, "test": testing}, indent=4))
        return files
