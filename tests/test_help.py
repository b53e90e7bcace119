"""Help where the user is: every command's keys with defaults and meaning from the schemas, the composed
configuration as Hydra users expect (--cfg job), and the nearest real key for a misspelt one."""
from __future__ import annotations

import yaml

from gems.cli import main
from gems.config import extensions, own_fields, schema_keys


def test_run_help_lists_every_key_with_its_default_and_meaning(capsys):
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    for key in schema_keys():
        assert f"  {key}=" in out, key
    assert extensions("model")  # (the registry loaded by the command)
    for name, schema in extensions("model").items():  # each model's own keys, under its name
        listed = out.split(f"  model.name={name} takes these too:\n", 1)[1]
        for f in own_fields(schema, "model"):
            assert f"    model.{f.name}=" in listed.split("takes these too")[0], (name, f.name)
    assert "fault.stall_timeout_s=60.0 [> 0]" in out and "parallel.schedule=lp [lp | gpipe | 1f1b" in out
    assert "interleaved1f1b" in out and "zbh1" in out  # the schedule list is the registry's


def test_cfg_job_prints_the_composed_configuration(capsys):
    assert main(["run", "model=unet3d", "train.steps=3", "--cfg", "job"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["model"]["name"] == "unet3d" and cfg["train"]["steps"] == 3


def test_a_misspelt_key_names_the_nearest_one(capsys):
    for bad, near in (("train.stepz=3", "train.steps"), ("parallel.pipline=2", "parallel.pipeline"),
                      ("fault.stall_timout_s=5", "fault.stall_timeout_s")):
        assert main(["run", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"expected {near}, the nearest key" in err[0], err
