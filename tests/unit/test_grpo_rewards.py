"""A user's GRPO reward that misbehaves, through `ao-mdm train`: it stops the run with one
`error:` line naming the reward function, the prompt and the answer, before anything is saved;
and the reward's time shows in the step's metrics (`reward_s`)."""

import json
import os

import pytest
from test_posttrain import pair_config

from ao_mdm.checkpoint import layout
from ao_mdm.train import loop
from helpers import ROOT, ao_mdm, error_lines

SMALL = [  # configs/grpo.py cut to the sp_export's model and a few answers
  "--config=configs/grpo.py",
  "--config.model.vocab_size=512",
  "--config.model.block_size=32",
  "--config.model.n_layer=2",
  "--config.model.n_head=2",
  "--config.model.n_embd=32",
  "--config.model.cond_dim=32",
  "--config.data.pairs=arithmetic:64",
  "--config.train.batch_size=8",
  "--config.grpo.group=4",
  "--config.train.num_steps=2",
  "--config.train.checkpoint_every=1",
]


@pytest.mark.slow  # three `ao-mdm train` processes, each stopping at its first step
@pytest.mark.parametrize(
  "reward, why",
  [
    ("not_a_number", "returned nan; a reward must be a finite number"),
    ("explodes", "raised RuntimeError: reward exploded on purpose"),
    ("says_high", "returned str 'high', not a number"),
  ],
)
def test_a_bad_reward_stops_the_run_naming_its_source_before_a_save(
  sp_export, sotu_config, tmp_path, reward, why
):
  workdir = tmp_path / "run"
  out = ao_mdm(
    "train",
    *SMALL,
    f"--config.grpo.reward=reward_fns:{reward}",
    f"--config.data.tfds_dir={sotu_config.tfds_dir}",
    f"--init_from={sp_export}",
    f"--workdir={workdir}",
    env={"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])},
  )
  assert out.returncode == 2, out.stderr
  errors = error_lines(out)
  assert len(errors) == 1, out.stderr
  assert errors[0].startswith(f"error: grpo.reward='reward_fns:{reward}' on prompt '"), errors
  assert "+" in errors[0].split("on prompt ")[1].split(", answer ")[0]  # a sum's prompt
  assert ", answer '" in errors[0] and errors[0].endswith(why), errors
  checkpoints = workdir / layout.CHECKPOINTS
  assert not checkpoints.exists() or not any(p.name.isdigit() for p in checkpoints.iterdir())
  metrics = workdir / layout.METRICS
  assert not metrics.exists() or all("reward" not in json.loads(x) for x in metrics.open())


@pytest.mark.slow  # one GRPO run of two steps
def test_the_rewards_time_is_logged(sp_export, sotu_config, tmp_path):
  config = pair_config(sotu_config.tfds_dir, 2, grpo=True)
  config = config.replace(grpo=config.grpo.replace(reward="reward_fns:slow"))
  loop.train_and_evaluate(config, str(tmp_path / "run"), init_from=sp_export, log=lambda _: None)
  records = [json.loads(x) for x in (tmp_path / "run" / layout.METRICS).open()]
  logged = [r for r in records if "reward" in r]
  assert len(logged) == 2
  for r in logged:  # 8 answers a step, 5 ms each
    assert 0.04 <= r["reward_s"] < r["rollout_s"] + r["scoring_s"] + 10
