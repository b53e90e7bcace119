"""nnU-Net's raw dataset folders, v1 and v2 (layout ``nnunet``), for ``model=unet3d``: a file a channel of each case
(``imagesTr/NAME_CCCC.nii.gz``), its labels in ``labelsTr/``, read as a Decathlon task (gems.data.layouts.decathlon):
a case's ``_0000`` file is its sample file, its other channels and its labels companions, the channels in the order
``dataset.json`` names them (docs/data.md, "nnU-Net's raw datasets").
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar, Iterable, Sequence

import numpy as np

from gems.data.layouts import listing, register
from gems.data.layouts.decathlon import CHANNEL, IMAGES, LABELS, MANIFEST, TEST, DecathlonLayout, channel_files
from gems.paths import commit


def _nii(name: str) -> str:
    """A file name as ``gems data convert`` writes it: ``.nii.gz`` made ``.nii``."""
    return name[:-3] if name.endswith(".nii.gz") else name


@register
class NnunetLayout(DecathlonLayout):
    name: ClassVar[str] = "nnunet"
    about: ClassVar[str] = ("nnU-Net's raw dataset folders: imagesTr/NAME_CCCC.nii.gz (a file a channel), "
                            "labelsTr/NAME.nii.gz and dataset.json (v1's or v2's), for model=unet3d")
    labels_where: ClassVar[str] = "nnU-Net's: labelsTr/NAME.nii.gz for imagesTr/NAME_0000.nii.gz"
    what: ClassVar[str] = "the nnU-Net dataset"

    def is_case(self, file: Path) -> bool:
        """Whether ``file`` is a case's first channel (``NAME_0000.nii.gz``)."""
        m = CHANNEL.match(file.name)
        return bool(m and m["channel"] == "0000")

    def files(self, path: str | os.PathLike) -> list[Path]:
        """The cases of the dataset at ``path``: each one's first channel (``imagesTr/NAME_0000``), by name."""
        p = Path(path)
        if p.is_file():  # one case (gems data check reads it alone)
            return [p] if p.parent.name == IMAGES and self.is_case(p) else []
        images = p / IMAGES
        if not (images.is_dir() and (p / LABELS).is_dir()):
            return []
        return [images / n for n in listing(images) if self.is_case(images / n)]

    def holds(self, files: Sequence[Path]) -> bool:
        return bool(files) and all(f.parent.name == IMAGES for f in files) and channel_files(files)

    def channel_files(self, volume: Path) -> list[Path]:
        """Case ``volume``'s files, one a channel in order: as many as dataset.json names, else as the folder holds
        for the case (``NAME_0000``, ``NAME_0001``, ...)."""
        m = CHANNEL.match(volume.name)
        if m is None:
            return [volume]
        case, ending = m["case"], m["ending"]
        names = self.channel_names(volume)
        count = len(names) if names else sum(1 for n in listing(volume.parent)
                                             if (c := CHANNEL.match(n)) and c["case"] == case and c["ending"] == ending)
        return [volume.with_name(f"{case}_{c:04d}{ending}") for c in range(max(count, 1))]

    def companions(self, file: Path) -> list[Path]:
        """The case's labels (``labelsTr/NAME``: the first), then its other channels' files."""
        m = CHANNEL.match(file.name)
        labels = file.parent.parent / LABELS / (f"{m['case']}{m['ending']}" if m else file.name)
        return [labels, *self.channel_files(file)[1:]]

    def converted_name(self, source: Path, tile: int | None = None) -> str:
        m = CHANNEL.match(source.name)
        if tile and m:  # one case of the tiled layout, named by the case
            return f"{m['case']}.h5"
        return super().converted_name(source, tile)

    def converted_manifest(self, task: dict[str, Any]) -> dict[str, Any]:
        """The converted dataset's ``dataset.json``: its files' endings ``.nii`` (v2's ``file_ending``, v1's
        training and test lists), so that nnU-Net reads the converted folder too."""
        out = dict(task)
        if "file_ending" in out:
            out["file_ending"] = _nii(str(out["file_ending"]))
        if isinstance(out.get("training"), list):
            out["training"] = [{k: _nii(v) if isinstance(v, str) else v for k, v in e.items()} if isinstance(e, dict)
                               else e for e in out["training"]]
        if isinstance(out.get("test"), list):
            out["test"] = [_nii(e) if isinstance(e, str) else e for e in out["test"]]
        return out

    def write(self, folder: str | os.PathLike, samples: Iterable[tuple[np.ndarray, np.ndarray]],
              name: str = "liver_{:03d}", compress: bool = True, spacing: Sequence[float] = (0.8, 0.8, 1.5), *,
              sync: bool = False, classes: Sequence[str] = ("background", "liver", "tumor"), test: int = 0,
              modality: Sequence[str] = ("CT",), version: int = 2) -> list[Path]:
        """A raw dataset as nnU-Net takes it, through nibabel: each case's channels ``imagesTr/NAME_CCCC.nii.gz``
        (int16, from voxels (C, z, y, x) or (z, y, x)), its labels ``labelsTr/NAME.nii.gz`` (uint8), ``test``
        cases more in ``imagesTs/`` (the last pairs', no labels) and ``dataset.json`` of nnU-Net ``version`` 1
        (``modality``, labels by number, the training pairs) or 2 (``channel_names``, labels by name,
        ``file_ending``); returns each training case's first channel."""
        import nibabel as nib

        out = Path(folder)
        affine = np.diag([*(float(s) for s in spacing), 1.0])
        ext = ".nii.gz" if compress else ".nii"
        pairs = [(np.asarray(v).reshape((-1, *np.asarray(v).shape[-3:])), np.asarray(g)) for v, g in samples]
        training, testing, files = [], [], []

        def save(arr: np.ndarray, final: Path, dtype: Any) -> None:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = final.with_name(f".{final.name}.tmp{ext}")
            img = nib.Nifti1Image(np.asarray(arr, dtype=dtype).T, affine)  # (z, y, x) in C order: (x, y, z) in F
            img.header.set_xyzt_units("mm")
            nib.save(img, str(tmp))
            commit(tmp, final, sync)

        for i, (vol, lab) in enumerate(pairs):
            case, held_out = name.format(i), i >= len(pairs) - test
            for c in range(vol.shape[0]):
                save(vol[c], out / (TEST if held_out else IMAGES) / f"{case}_{c:04d}{ext}", np.int16)
            if held_out:
                testing.append(f"./{TEST}/{case}{ext}")
                continue
            save(lab, out / LABELS / f"{case}{ext}", np.uint8)
            training.append({"image": f"./{IMAGES}/{case}{ext}", "label": f"./{LABELS}/{case}{ext}"})
            files.append(out / IMAGES / f"{case}_0000{ext}")
        if version == 1:
            manifest: dict[str, Any] = {
                "name": "Liver", "description": "written by gems for its tests, as nnU-Net v1's", "tensorImageSize": "4D",
                "modality": {str(k): m for k, m in enumerate(modality)},
                "labels": {str(k): c for k, c in enumerate(classes)}, "numTraining": len(training),
                "numTest": len(testing), "training": training, "test": testing}
        else:
            manifest = {"channel_names": {str(k): m for k, m in enumerate(modality)},
                        "labels": {c: k for k, c in enumerate(classes)}, "numTraining": len(training),
                        "file_ending": ext, "name": "Liver"}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=4))
        return files
