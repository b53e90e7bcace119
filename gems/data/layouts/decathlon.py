"""The Medical Segmentation Decathlon's task folders (layout ``decathlon``), for ``model=unet3d``: ``imagesTr/`` and
``labelsTr/`` read as LiTS's volumes are (gems.data.layouts.nifti), the classes and modalities from ``dataset.json``
(docs/data.md, "The Medical Segmentation Decathlon"). The helpers here read any ``dataset.json`` of the family:
the Decathlon's, nnU-Net v1's and v2's; gems.data.layouts.nnunet extends this layout.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, ClassVar, Iterable, Sequence

import numpy as np

from gems.data.layouts import listing, register
from gems.data.layouts.nifti import NiftiLayout, missing_labels, uncompressed
from gems.errors import ConfigError
from gems.paths import commit

IMAGES, LABELS, TEST, MANIFEST = "imagesTr", "labelsTr", "imagesTs", "dataset.json"
_NII = re.compile(r"^[^.].*\.nii(\.gz)?$")
#: nnU-Net's image of one channel of a case: ``NAME_CCCC.nii.gz`` (its labels: ``NAME.nii.gz``)
CHANNEL = re.compile(r"^(?P<case>.+)_(?P<channel>\d{4})(?P<ending>\.nii(\.gz)?)$")


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


def _numbered(raw: Any, what: str, key: str, path: str | os.PathLike) -> list[str]:
    """``raw`` ({"0": name, ...}, the Decathlon's and nnU-Net v1's; or {name: 0, ...}, nnU-Net v2's) as the names
    in order, numbered 0 .. n-1; else bad input naming ``what``."""
    try:
        items = dict(raw).items()
        v2 = all(not str(k).strip().isdigit() for k, _ in items)
        if v2 and any(not isinstance(v, int) for _, v in items):  # nnU-Net v2's regions: a list of labels a name
            raise ConfigError(key, str(path), f"dataset.json's {what} one label a class; it holds regions "
                              f"({str(raw)[:120]}), which gems does not read")
        names = {int(v): str(k) for k, v in items} if v2 else {int(k): str(v) for k, v in items}
    except (TypeError, ValueError):
        raise ConfigError(key, str(path), f"dataset.json's {what} as {{\"0\": \"background\", \"1\": ...}} (or "
                          f"nnU-Net v2's {{\"background\": 0, ...}}); it holds {str(raw)[:120]}") from None
    if sorted(names) != list(range(len(names))):
        raise ConfigError(key, str(path), f"dataset.json's {what} numbered 0 .. n-1; it numbers {sorted(names)}")
    return [names[k] for k in range(len(names))]


def labels_of(task: dict[str, Any] | None, key: str, path: str | os.PathLike) -> list[str] | None:
    """The classes' names by label, from ``dataset.json``'s ``labels`` (``{"0": "background", "1": "liver"}``, or
    nnU-Net v2's ``{"background": 0, "liver": 1}``), which must number them 0 .. n-1; None without one."""
    if task is None or "labels" not in task:
        return None
    return _numbered(task["labels"], "labels", key, path)


def channels_of(task: dict[str, Any] | None, key: str, path: str | os.PathLike) -> list[str] | None:
    """The channels' names in order, from ``dataset.json``'s ``channel_names`` (nnU-Net v2) or ``modality`` (the
    Decathlon's, nnU-Net v1's): ``{"0": "FLAIR", "1": "T1w", ...}``; None without either."""
    for field in ("channel_names", "modality"):
        if task is not None and field in task:
            return [str(v) for v in _numbered({str(k): str(v) for k, v in dict(task[field]).items()}, field, key, path)]
    return None


def channel_files(files: Sequence[Path]) -> bool:
    """Whether ``files`` (of ``imagesTr/``) are channels of nnU-Net's cases (each ``NAME_CCCC.nii.gz``, the first
    without labels of its own name beside it) rather than a Decathlon task's volumes."""
    return (bool(files) and all(CHANNEL.match(f.name) for f in files)
            and not (files[0].parent.parent / LABELS / files[0].name).is_file())


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
        return bool(files) and all(f.parent.name == IMAGES for f in files) and not channel_files(files)

    def root(self, path: str | os.PathLike) -> Path:
        return _task(path)

    def shown(self, file: Path) -> str:
        """A file of the task in a message: its folder and name (an image and its labels share the name)."""
        return f"{file.parent.name}/{file.name}"

    def folder_files(self, path: str | os.PathLike) -> list[Path]:
        """The task's ``dataset.json`` (copied where the run stages its files; it names the classes)."""
        f = _task(path) / MANIFEST
        return [f] if f.is_file() else []

    def class_names(self, path: str | os.PathLike) -> list[str] | None:
        return labels_of(manifest(path), "data.path", path)

    def channel_names(self, path: str | os.PathLike) -> list[str] | None:
        return channels_of(manifest(path), "data.path", path)

    def declared(self, path: str | os.PathLike) -> dict[str, list[str]]:
        """``dataset.json``'s classes and channels (gems.data.task sets the model by them)."""
        task = manifest(path)
        got = {"model.num_classes": labels_of(task, "data.path", path),
               "model.in_channels": channels_of(task, "data.path", path)}
        return {k: v for k, v in got.items() if v}

    #: the set in a run's notes
    what: ClassVar[str] = "the Decathlon task"

    def folder_notes(self, path: str | os.PathLike, key: str) -> list[str]:
        test = _task(path) / TEST
        n = len([f for f in listing(test) if self.is_case(test / f)]) if test.is_dir() else 0
        task = manifest(path, key) or {}
        said = f" ({task['name']})" if isinstance(task.get("name"), str) else ""
        return [f"{key}: {self.what}{said}: {TEST}/ ({n} volumes without labels) left out"] if n else []

    def is_case(self, file: Path) -> bool:
        """Whether ``file`` (a name in an images folder) is a case's first file (here: any NIfTI volume)."""
        return bool(_NII.match(file.name))

    def converted_name(self, source: Path, tile: int | None = None) -> str:
        if tile:
            return super().converted_name(source, tile)
        return f"{IMAGES}/{source.name[:-3] if source.name.endswith('.gz') else source.name}"

    def converted_manifest(self, task: dict[str, Any]) -> dict[str, Any]:
        """The ``dataset.json`` of the converted task (the Decathlon's: as it was)."""
        return task

    def convert(self, source: Path, folder: Path, channels: int | None = None, key: str = "data.path",
                tile: int | None = None, tolerance: float | None = None) -> Path:
        """A training case's files (its labels, its other channels' files, then the volume: written last, so that
        once it is there so are the others) written uncompressed into the task folder ``folder`` under their
        folders (``imagesTr/``, ``labelsTr/``; ``dataset.json`` beside them, once), or with ``tile`` one case of the
        tiled layout (its classes dataset.json's); returns the volume's path."""
        lab = self.companions(source)[0]
        if not lab.is_file():
            raise missing_labels(source, lab, key, self.labels_where, self.shown)
        if tile:
            return super().convert(source, folder, channels, key, tile, tolerance)
        task = manifest(source, key)
        if task is not None and not (folder / MANIFEST).is_file():
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{MANIFEST}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(self.converted_manifest(task), indent=4))
            commit(tmp, folder / MANIFEST)
        for src in (*self.companions(source), source):
            if not src.is_file():
                raise ConfigError(key, str(self.root(source)), f"every file of a case; {self.shown(src)} is missing "
                                  f"for {self.shown(source)}")
            dst = folder / src.parent.name / (src.name[:-3] if src.name.endswith(".gz") else src.name)
            dst.parent.mkdir(parents=True, exist_ok=True)
            uncompressed(src, dst, key)
        return folder / self.converted_name(source)

    def write(self, folder: str | os.PathLike, samples: Iterable[tuple[np.ndarray, np.ndarray]],
              name: str = "liver_{}", compress: bool = True, spacing: Sequence[float] = (0.8, 0.8, 1.5), *,
              sync: bool = False, classes: Sequence[str] = ("background", "liver", "cancer"),
              test: int = 1, modality: Sequence[str] = ("CT",)) -> list[Path]:
        """A task folder as the Decathlon ships it, through nibabel: ``imagesTr/liver_N.nii.gz`` (int16, HU; of
        several ``modality``, a 4D volume whose 4th dim holds them) and ``labelsTr/liver_N.nii.gz`` (uint8) from
        (voxels (C, z, y, x) or (z, y, x), labels) pairs, ``test`` volumes more in ``imagesTs/`` (the last pairs'
        voxels, no labels), macOS's ``._`` forks beside each and ``dataset.json`` (its classes ``classes``, the
        modalities, the training pairs and the test volumes, with the Decathlon's ``./`` paths); returns the
        training volumes' paths."""
        import nibabel as nib

        out = Path(folder)
        shape = (len(modality),) if len(modality) > 1 else ()
        pairs = [(np.asarray(v).reshape(shape + np.asarray(v).shape[-3:]), np.asarray(g)) for v, g in samples]
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
                img = nib.Nifti1Image(np.asarray(arr, dtype=dt).T, affine)  # (C, z, y, x) in C order: (x, y, z, C) in F
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
            "name": "Liver", "description": "written by gems for its tests, as the Decathlon's",
            "modality": {str(k): m for k, m in enumerate(modality)},
            "labels": {str(k): c for k, c in enumerate(classes)}, "numTraining": len(training),
            "numTest": len(testing), "training": training, "test": testing}, indent=4))
        return files

