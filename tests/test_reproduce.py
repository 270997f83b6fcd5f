"""tools/reproduce.py: the RESULTS.md table and the training plots, from
metrics and evaluation results shaped like the real jobs write them."""

import json
import os
import shutil
import types

import numpy as np
import pytest
from absl import app

from cmimem_jax.data import bundled_path
from cmimem_jax.memory import MemoryBank
from cmimem_jax.memory.types import MemoryEntry, MemoryType
from configs import small_repro
from tools import reproduce


def _result(overall: float, temporal: float) -> dict:
  by_category = {"adversarial": 0.0, "single-hop": 1.0, "temporal": temporal}
  return {"n": 4, "by_category": by_category,
          "n_by_category": {"adversarial": 1, "single-hop": 1, "temporal": 2},
          "context_recall": {"overall": overall, "by_category": by_category,
                             "excluded_from_overall": ["adversarial"]},
          "evidence_recall": {"overall": 0.5, "by_category": {}}}


def test_results_table_has_one_row_per_category_and_missing_cells_marked():
  table = reproduce.results_table({"initial": _result(0.0, 0.0),
                                   "rl": _result(0.25, 0.125)})
  lines = table.splitlines()
  assert lines[0].startswith("| category | n | initial ctx recall")
  assert lines[2] == "| adversarial | 1 | 0.000 | — | 0.000 | — |"
  assert lines[3] == "| single-hop | 1 | 1.000 | — | 1.000 | — |"
  assert lines[4] == "| temporal | 2 | 0.000 | — | 0.125 | — |"
  # The overall figure leaves adversarial out, and its n says so.
  assert lines[5] == ("| overall (without adversarial) | 3 | 0.000 | 0.500 "
                      "| 0.250 | 0.500 |")


def test_plots_are_written_and_counts_stay_off_the_reward_axes(tmp_path):
  rl = [{"step": s, "reward/qa": 0.1 * s, "reward/cmi": 0.2,
         "reward/num_scored_operations": 40.0, "validity_rate": 1.0,
         "response_tokens_mean": 60.0, "kl": 0.01 * s,
         "reward_group_std": 0.05} for s in (1, 2, 3)]
  sft = [{"step": s, "nll": 2.0 / s} for s in (1, 2)]
  assert reproduce.plot_training(rl, sft, str(tmp_path)) == [
      "reward_terms.png", "rollout_stats.png", "warm_start_loss.png"]
  for s in (2, 3):  # Validated every 2 steps and at the last.
    rl[s - 1].update({"eval/reward": 0.3, "eval/qa": 0.2, "eval/cmi": 0.1,
                      "eval/sessions": 2})
  names = reproduce.plot_training(rl, sft, str(tmp_path))
  assert names == ["reward_terms.png", "rollout_stats.png",
                   "validation.png", "warm_start_loss.png"]
  for name in names:
    assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
  assert reproduce.reward_terms(rl) == ["reward/cmi", "reward/qa"]
  assert reproduce.plot_training(rl, [], str(tmp_path))[-1] == (
      "validation.png")


def test_stages_expand_in_pipeline_order_and_unknown_ones_are_refused():
  assert reproduce.parse_stages(["all"]) == [
      "teacher", "warm_start", "grpo", "grpo_qa_only", "grpo_cmi_only",
      "eval_initial", "eval_warm_start", "eval_rl", "eval_rl_qa_only",
      "eval_rl_cmi_only", "eval_equal_budget", "report"]
  assert reproduce.parse_stages(["report", "evaluate", "teacher"]) == [
      "teacher", "eval_initial", "eval_warm_start", "eval_rl",
      "eval_rl_qa_only", "eval_rl_cmi_only", "eval_equal_budget", "report"]
  with pytest.raises(app.UsageError, match="unknown stage 'grpo_qa'"):
    reproduce.parse_stages(["grpo_qa"])


def _records(scores: dict[str, tuple[str, float | None]]) -> dict:
  return {qid: {"question_id": qid, "category": category,
                "context_recall": value, "evidence_recall": None}
          for qid, (category, value) in scores.items()}


def _retrieved(dialogue: str, lists: list[list[str]], chars: int | None
               ) -> dict[str, dict]:
  return {f"{dialogue}:q{i}": {"question_id": f"{dialogue}:q{i}",
                               "dialogue_id": dialogue, "retrieved": ids,
                               **({} if chars is None else
                                  {"context_chars": chars + i})}
          for i, ids in enumerate(lists)}


def test_a_policy_retrieving_one_list_for_most_questions_is_flagged():
  """Round five's CMI-alone arm on conv-49: every question retrieved the
  same list. Distinct lists and the most common list's share per
  dialogue; more than half on one list, or fewer distinct lists than a
  tenth of the questions, is degenerate."""
  same = [["e1", "e4", "e7"]] * 3 + [["e2"]]
  varied = [["e1"], ["e2"], ["e3"], ["e1", "e2"]]
  records = {"rl_cmi_only": {**_retrieved("conv-49", same, 150_000),
                             **_retrieved("conv-50", varied, None)},
             "rl": _retrieved("conv-49", varied, 900)}
  rows = {(r["policy"], r["dialogue"]): r
          for r in reproduce.retrieval_rows(records)}
  flagged = rows["rl_cmi_only", "conv-49"]
  assert (flagged["distinct_lists"], flagged["top_list_share"],
          flagged["degenerate"]) == (2, 0.75, True)
  assert flagged["mean_context_chars"] == 150_001.5
  # Records written before context sizes were recorded: no size.
  assert rows["rl_cmi_only", "conv-50"]["mean_context_chars"] is None
  assert not rows["rl_cmi_only", "conv-50"]["degenerate"]
  assert rows["rl", "conv-49"]["distinct_lists"] == 4
  # Round eight's CMI-alone arm on conv-49: 3 lists for 196 questions, the
  # most common on 46 %: fewer lists than a tenth of the questions.
  few = [["e1"], ["e2"], ["e3"]] * 13 + [["e1"]]
  (few_lists,) = reproduce.retrieval_rows(
      {"rl_cmi_only": _retrieved("conv-49", few, 900)})
  assert few_lists["top_list_share"] < 0.5 and few_lists["degenerate"]
  (many,) = reproduce.retrieval_rows(
      {"rl": _retrieved("conv-49", few[:9] + [[f"x{i}"] for i in range(31)],
                        900)})
  assert many["distinct_lists"] == 34 and not many["degenerate"]
  text = "\n".join(reproduce.retrieval_section(records, ""))
  assert "| rl_cmi_only | conv-49 | 4 | 2 | 75% | 150,002 | **yes** |" in text
  assert "| rl_cmi_only | conv-50 | 4 | 4 | 25% | — | no |" in text
  assert "**Degenerate**" in text and "rl_cmi_only on conv-49." in text


def test_the_equal_budget_stage_evaluates_the_same_banks_capped(
    tmp_path, monkeypatch):
  """`eval_equal_budget`: each evaluated policy's banks copied, evaluated
  from the checkpoint its evaluation read with LookupChunk capped at
  `repro.equal_budget_chars`; a policy already done is not redone; the
  report adds the results at that budget."""
  dialogues = [types.SimpleNamespace(dialogue_id=f"conv-{i}")
               for i in range(10)]
  monkeypatch.setattr(reproduce, "load_dataset", lambda *_: dialogues)
  calls = []

  def evaluate(config, directory):
    calls.append((os.path.basename(directory),
                  config.memory.chunk_budget_chars,
                  config.builder.init_checkpoint,
                  config.builder.checkpoint_step,
                  sorted(os.listdir(os.path.join(directory, "banks",
                                                 "policy")))))
    with open(os.path.join(directory, "results.json"), "w") as f:
      json.dump(_result(0.5, 0.0), f)
    with open(os.path.join(directory, "settings.json"), "w") as f:
      json.dump({"memory": config.memory.to_dict()}, f)
    with open(os.path.join(directory, "predictions.jsonl"), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in _retrieved(
          "conv-8", [["e1"]] * 2, 8000).values())

  monkeypatch.setattr(reproduce, "evaluate", evaluate)
  config = small_repro.get_config()
  assert config.evaluation.memory.chunk_budget_chars == 160_000
  for policy, run, step in (("warm_start", "sft", 0), ("rl", "rl", 4)):
    directory = tmp_path / "eval" / policy
    MemoryBank("u", 4).save(str(directory / "banks" / "policy" / "conv-8"))
    (directory / "results.json").write_text(json.dumps(_result(1.0, 0.0)))
    (directory / "evaluated.json").write_text(json.dumps(
        {"run": str(tmp_path / run), "step": step}))
  reproduce.reproduce(config, str(tmp_path), ["eval_equal_budget"])
  budget = config.repro.equal_budget_chars
  assert calls == [("warm_start", budget, str(tmp_path / "sft"), 0,
                    ["conv-8"]),
                   ("rl", budget, str(tmp_path / "rl"), 4, ["conv-8"])]
  reproduce.reproduce(config, str(tmp_path), ["eval_equal_budget"])
  assert len(calls) == 2  # Done once; never recorded as a finished stage.
  assert "eval_equal_budget" not in reproduce.StageRecord(
      str(tmp_path)).done
  text = reproduce.reproduce(config, str(tmp_path), ["report"])
  assert f"## At a common LookupChunk budget ({budget:,} characters" in text
  assert f"### Retrieval per dialogue ({budget:,} characters)" in text
  assert "| rl | conv-8 | 2 | 1 | 100% | 8,000 | **yes** |" in text


def test_grpo_reads_memories_alone_and_the_evaluation_keeps_lookupchunk():
  """r_QA in training without source chunks (it must tell rollouts apart);
  the held-out evaluation keeps the paper's LookupChunk protocol."""
  config = small_repro.get_config()
  assert not config.memory.source_chunks
  assert config.evaluation.memory.source_chunks


def test_checkpoint_is_chosen_on_validation_among_kept_steps():
  metrics = [{"step": 1, "eval/reward": 0.9},
             {"step": 2, "eval/reward": 0.3}, {"step": 3},
             {"step": 4, "eval/reward": 0.5, "eval/qa": 0.1},
             {"step": 5, "eval/reward": 0.5},
             {"step": 6, "eval/reward": 0.5, "eval/qa": 0.9}]
  # Step 1 has no kept checkpoint (period 2); 4 and 6 tie: the later.
  assert reproduce.chosen_step(metrics, 2) == 6
  assert reproduce.chosen_step(metrics[:4], 2) == 4
  assert reproduce.chosen_step([{"step": 2}], 2) == 0
  assert reproduce.chosen_step(metrics, 0) == 0


def test_arms_table_sets_the_two_runs_side_by_side():
  def run(pg: list[float]) -> list[dict]:
    return [{"step": s + 1, "reward_mean": 0.5, "reward/qa": 0.4,
             "reward/cmi": 0.1, "response_tokens_mean": 50.0 + s,
             "pg_loss": v, "validity_rate": 1.0, "kl": 0.01,
             "reward/semantic_skip": 0.25 * s,
             **({"eval/qa": 0.2, "eval/reward": 0.3 * s,
                 "reward/semantic_skip_justified": 0.5} if s % 2 else {})}
            for s, v in enumerate(pg)]
  table = reproduce.arms_table({"CMI+QA": run([0.1, -0.1]),
                                "QA only": run([0.3, 0.5])}, 2)
  lines = table.splitlines()
  assert lines[0] == "| measure | CMI+QA | QA only |"
  rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in lines}
  assert rows["policy-gradient loss"] == ["0.0000 ± 0.1000",
                                          "0.4000 ± 0.1000 |"]
  assert rows["policy-gradient loss, absolute"][0] == "0.1000 ± 0.0000"
  assert rows["response tokens"][0] == "50.5000 ± 0.5000"
  assert rows["evaluated step (best validation reward)"] == ["2", "2 |"]
  # The justified share is over the steps that logged a SKIP only.
  assert rows["Semantic SKIP rate (rollouts)"][0] == "0.1250 ± 0.1250"
  assert rows["Semantic SKIPs judged justified"][0] == "0.5000 ± 0.0000"


def test_bank_sizes_count_entries_per_type(tmp_path):
  bank = MemoryBank("u", 4)
  bank.core = "likes tea"
  entry = MemoryEntry("e1", MemoryType.EPISODIC, "went hiking", 0, 0, 0)
  bank.stores[MemoryType.EPISODIC].add(entry, np.ones(4, np.float32))
  bank.save(str(tmp_path / "conv-1"))
  MemoryBank("v", 4).save(str(tmp_path / "conv-2"))
  assert reproduce.bank_sizes(str(tmp_path)) == {
      "core chars": 9, "episodic": 1, "semantic": 0, "procedural": 0}
  assert reproduce.bank_sizes(str(tmp_path / "missing")) is None


def test_stages_run_once_in_order_and_resume(tmp_path, monkeypatch):
  """Stage bookkeeping with the jobs replaced by recorders: a stage whose
  input is missing is refused, a finished one is skipped on a rerun, and
  the QA-only arm differs from the CMI+QA one in alpha alone."""
  dialogues = [types.SimpleNamespace(dialogue_id=f"conv-{i}")
               for i in range(10)]
  calls = []
  monkeypatch.setattr(reproduce, "load_dataset", lambda *_: dialogues)
  monkeypatch.setattr(reproduce, "make_encoder", lambda _: None)
  monkeypatch.setattr(reproduce, "load_tokenizer", lambda _: None)
  monkeypatch.setattr(reproduce, "annotation_trajectories",
                      lambda teachers, *_: (calls.append(
                          ("teacher", len(teachers)))
                                            or [{"retrieved_per_type": 3}], 0))
  monkeypatch.setattr(reproduce, "run_sft", lambda c, d: calls.append(
      ("warm_start", os.path.basename(d), c.checkpoint.keep_period)))
  monkeypatch.setattr(reproduce, "train", lambda c, d: calls.append(
      ("train", os.path.basename(d), c.reward.alpha,
       os.path.basename(c.policy.init_checkpoint))) or "")
  config = small_repro.get_config()
  workdir = str(tmp_path)
  with pytest.raises(app.UsageError, match="run --stages=warm_start"):
    reproduce.reproduce(config, workdir, ["grpo"])
  reproduce.reproduce(config, workdir, ["teacher", "warm_start", "grpo",
                                        "grpo_qa_only", "grpo_cmi_only"])
  # The warm start keeps its newest checkpoint only; the arms keep every
  # `keep_period`-th step, for the validation curve to pick from.
  assert config.checkpoint.keep_period == 2
  assert calls == [("teacher", 8), ("warm_start", "sft", 0),
                   ("train", "rl", config.reward.alpha, "sft"),
                   ("train", "rl_qa_only", 0.0, "sft"),
                   ("train", "rl_cmi_only", 1.0, "sft")]
  assert 0 < config.reward.alpha < 1  # The arms run on copies.
  reproduce.reproduce(config, workdir, ["teacher", "warm_start"])
  assert len(calls) == 5
  assert set(json.loads((tmp_path / "stages.json").read_text())) == {
      "teacher", "warm_start", "grpo", "grpo_qa_only", "grpo_cmi_only"}
  # A report before any evaluation says so instead of failing.
  text = reproduce.reproduce(config, workdir, ["report"])
  assert "No policy evaluated yet" in text and "Paired" not in text


def test_another_seed_reuses_the_finished_seed_independent_stages(tmp_path):
  """`--reuse`: the warm start linked, the teacher data and the initial /
  warm-start evaluations copied and recorded with the source's seconds;
  stages the source has not finished, or this run has, are left alone."""
  source, target = tmp_path / "seed0", tmp_path / "seed1"
  (source / "sft" / "checkpoints").mkdir(parents=True)
  (source / "sft_data.jsonl").write_text('{"x": 1}\n')
  (source / "eval" / "initial").mkdir(parents=True)
  (source / "eval" / "initial" / "results.json").write_text("{}")
  (source / "stages.json").write_text(json.dumps(
      {"teacher": 47.2, "warm_start": 1425.4, "grpo": 1258.1,
       "eval_initial": 295.3}))
  target.mkdir()
  (target / "stages.json").write_text(json.dumps({"eval_initial": 1.0}))
  record = reproduce.StageRecord(str(target))
  reproduce.reuse_stages(str(target), str(source), record)
  assert (target / "sft").is_symlink()
  assert (target / "sft").resolve() == (source / "sft").resolve()
  assert (target / "sft_data.jsonl").read_text() == '{"x": 1}\n'
  # grpo depends on the seed; eval_initial was already this run's own;
  # eval_warm_start was not finished in the source.
  assert json.loads((target / "stages.json").read_text()) == {
      "eval_initial": 1.0, "teacher": 47.2, "warm_start": 1425.4}
  assert not (target / "eval" / "initial").exists()
  assert not (target / "eval" / "warm_start").exists()


def test_report_is_written_from_what_has_been_evaluated(tmp_path,
                                                        monkeypatch):
  """RESULTS.md from two evaluated policies and both arms' metrics: the
  paired differences, the arms side by side, the banks and the plots."""
  dialogues = [types.SimpleNamespace(dialogue_id=f"conv-{i}")
               for i in range(10)]
  monkeypatch.setattr(reproduce, "load_dataset", lambda *_: dialogues)
  for policy, value in (("initial", 0.0), ("warm_start", 1.0)):
    directory = tmp_path / "eval" / policy
    directory.mkdir(parents=True)
    (directory / "results.json").write_text(json.dumps(_result(value, 0.0)))
    (directory / "predictions.jsonl").write_text("".join(
        json.dumps(r) + "\n" for r in _records(
            {"a": ("single-hop", value), "b": ("temporal", 0.0)}).values()))
    MemoryBank("u", 4).save(str(directory / "banks" / "policy" / "conv-8"))
  for run, pg in (("rl", 0.01), ("rl_qa_only", -0.2)):
    (tmp_path / run).mkdir()
    (tmp_path / run / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "pg_loss": pg * s, "reward/qa": 0.1, "kl": 0.0,
         "validity_rate": 1.0, "response_tokens_mean": 40.0,
         "reward_group_std": 0.1}) + "\n" for s in (1, 2)))
  (tmp_path / "stages.json").write_text(json.dumps({"eval_initial": 9.5}))
  command = ("python -m tools.reproduce --config=configs/small_repro.py "
             "--config.sft.trim_retrieved=True --stages=report")
  text = reproduce.reproduce(small_repro.get_config(), str(tmp_path),
                             ["report"], command=command)
  assert (tmp_path / "RESULTS.md").read_text() == text
  assert f"`{command}`" in text  # The overrides say what ran.
  assert ("| warm_start − initial | context_recall | 2 | 0.500 | 0.000 | "
          "+0.500 [") in text
  assert "| measure | CMI+QA | QA only |" in text
  assert "| policy-gradient loss | 0.0150 ± 0.0050 | -0.3000 ± 0.1000 |" in (
      text)
  assert "| warm_start | 0 | 0 | 0 | 0 |" in text
  assert "| eval_initial | 9.5 |" in text
  for name in ("reward_terms.png", "rollout_stats.png", "arms.png"):
    assert f"![{name}]({name})" in text
    assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
  assert json.loads((tmp_path / "differences.json").read_text())[0][
      "policy"] == "warm_start"
  assert "Seeds pooled" not in text
  assert "- GRPO (every arm): the bundled LongMemEval training sample" in text
  # Another training set is named by its file.
  filler = small_repro.get_config()
  filler.dataset.path = bundled_path("longmemeval_train_with_filler.json")
  assert ("- GRPO (every arm): `longmemeval_train_with_filler.json` "
          "(per-session QA)") in reproduce.reproduce(filler, str(tmp_path),
                                                     ["report"])
  # Another seed's workdir, pooled: its own and the averaged difference.
  other = tmp_path / "seed1"
  shutil.copytree(tmp_path / "eval", other / "eval")
  pooled = reproduce.reproduce(small_repro.get_config(), str(tmp_path),
                               ["report"], pool=[str(other)])
  assert f"## Seeds pooled (2 runs: this one, {other})" in pooled
  assert ("| warm_start − initial | context_recall | 2 | +0.500, +0.500 | "
          "+0.500 [") in pooled
  assert json.loads((tmp_path / "pooled_differences.json").read_text())[
      "workdirs"] == [str(tmp_path), str(other)]
  # A workdir of another setting on the same split: each policy evaluated
  # in both, paired (here only the warm start).
  setting = tmp_path / "no_trim"
  shutil.copytree(tmp_path / "eval" / "initial",
                  setting / "eval" / "warm_start")
  compared = reproduce.reproduce(small_repro.get_config(), str(tmp_path),
                                 ["report"], compare=str(setting))
  assert f"## This workdir − {setting} (same split" in compared
  rows = [line for line in compared.splitlines()
          if line.startswith(f"| warm_start ({tmp_path.name}) − ")]
  assert len(rows) == 1 and rows[0].startswith(
      f"| warm_start ({tmp_path.name}) − warm_start (no_trim) | "
      "context_recall | 2 | 0.500 | 0.000 | +0.500 [")
  assert json.loads((tmp_path / "compared.json").read_text())["rows"][0][
      "n"] == 2


def test_learning_rate_is_picked_per_arm_on_the_validation_curve(tmp_path):
  """Two workdirs of one warm start, the arms at lr 1e-5 (this one) and
  3e-5 (swept): per arm the rate with the best validation reward at a
  kept step is picked; a swept workdir must say its rate."""
  def write_arm(directory, run: str, rewards: list[float],
                rate: float | None) -> None:
    os.makedirs(directory / run)
    (directory / run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, **({"eval/reward": r} if r is not None
                                  else {})}) + "\n"
        for s, r in enumerate(rewards, 1)))
    if rate is not None:
      (directory / run / "config.json").write_text(json.dumps(
          {"rl": {"learning_rate": rate}}))

  here, swept = tmp_path / "lr1", tmp_path / "lr3"
  # Step 1 is not kept (period 2): its 0.9 cannot pick a rate.
  write_arm(here, "rl", [0.9, 0.2, None, 0.4], None)
  write_arm(here, "rl_qa_only", [None, 0.1, None, 0.1], None)
  write_arm(swept, "rl", [None, 0.3, None, 0.35], 3e-5)
  write_arm(swept, "rl_qa_only", [None, 0.0, None, 0.1], 3e-5)
  workdirs = reproduce.swept_workdirs(str(here), 1e-5, [str(swept)])
  assert workdirs == {1e-5: str(here), 3e-5: str(swept)}
  rows = reproduce.sweep_rows(workdirs, 2)
  text = reproduce.sweep_report(str(here), workdirs, rows)
  assert "| CMI+QA | **1e-05** | 0.2000 | 0.4000 | **0.4000 (4)** |" in text
  assert "| CMI+QA | 3e-05 | 0.3000 | 0.3500 | 0.3500 (4) |" in text
  # QA only ties at 0.1: the larger rate (it moved further) is picked.
  assert "| QA only | **3e-05** | 0.0000 | 0.1000 | **0.1000 (4)** |" in text
  assert "Picked (bold, the best validation reward at any kept step): " \
         "CMI+QA 1e-05, QA only 3e-05; `eval_rl`" in text
  assert (here / "sweep.md").read_text() == text
  assert (here / "sweep.png").read_bytes()[:4] == b"\x89PNG"
  assert json.loads((here / "sweep.json").read_text())["workdirs"] == [
      str(here), str(swept)]
  # Each arm is evaluated from the run of its picked rate.
  assert reproduce.picked_runs(rows, workdirs) == {
      "rl": str(here / "rl"), "rl_qa_only": str(swept / "rl_qa_only")}
  with pytest.raises(app.UsageError, match="already in the sweep"):
    reproduce.swept_workdirs(str(here), 3e-5, [str(swept)])
  os.remove(swept / "rl" / "config.json")
  with pytest.raises(app.UsageError, match="has no config.json"):
    reproduce.swept_workdirs(str(here), 1e-5, [str(swept)])


def test_an_arm_is_evaluated_from_the_rate_and_step_its_validation_picks(
    tmp_path, monkeypatch):
  """`--stages=eval_rl_qa_only --sweep=DIR2`: the QA-only arm of the
  swept workdir (better validation) is evaluated at its best kept step,
  and the report says which checkpoint each evaluation read."""
  dialogues = [types.SimpleNamespace(dialogue_id=f"conv-{i}")
               for i in range(10)]
  monkeypatch.setattr(reproduce, "load_dataset", lambda *_: dialogues)
  evaluated = []

  def fake_evaluate(evaluation, output: str) -> None:
    evaluated.append((evaluation.builder.init_checkpoint,
                      evaluation.builder.checkpoint_step,
                      evaluation.dataset.start, evaluation.dataset.dialogues))
    os.makedirs(output)
    with open(os.path.join(output, "results.json"), "w") as f:
      json.dump(_result(0.5, 0.0), f)

  monkeypatch.setattr(reproduce, "evaluate", fake_evaluate)
  here, swept = tmp_path / "lr1", tmp_path / "lr3"
  for directory, rate, rewards in ((here, 1e-5, [0.1, 0.2]),
                                   (swept, 3e-5, [0.3, 0.1])):
    for run in ("rl", "rl_qa_only"):
      (directory / run).mkdir(parents=True)
      (directory / run / "metrics.jsonl").write_text("".join(json.dumps(
          {"step": s, "pg_loss": 0.0, "reward/qa": r, "kl": 0.0,
           "validity_rate": 1.0, "response_tokens_mean": 40.0,
           "reward_group_std": 0.1, "eval/reward": r, "eval/qa": r,
           "eval/cmi": 0.0, "eval/sessions": 2}) + "\n"
          for s, r in zip((2, 4), rewards)))
      (directory / run / "config.json").write_text(json.dumps(
          {"rl": {"learning_rate": rate}}))
  # The picked QA-only run's GRPO finished in the swept workdir, not here.
  (here / "stages.json").write_text(json.dumps({"grpo": 1.0}))
  (swept / "stages.json").write_text(json.dumps({"grpo_qa_only": 1.0}))
  config = small_repro.get_config()
  text = reproduce.reproduce(config, str(here),
                             ["eval_rl_qa_only", "report"],
                             sweep=[str(swept)])
  assert evaluated == [(str(swept / "rl_qa_only"), 2, 8, 2)]
  assert (f"Checkpoints evaluated: rl_qa_only: `{swept / 'rl_qa_only'}` "
          "step 2.") in text
  # The arms table reports the evaluated (picked) runs' curves.
  assert "Picked (bold, the best validation reward at any kept step): " \
         "CMI+QA 3e-05, QA only 3e-05" in text
  # The sweep's section starts after a blank line, not inside a table.
  assert "|\n\n## GRPO learning rate on the validation curve" in text


def test_the_documented_commands_run_the_whole_recipe(tmp_path, monkeypatch):
  """configs/small_repro.py's two commands, run as written (paths changed)
  with `reproduce` recording its calls: every arm in two seeds from one
  warm start, the learning-rate sweep when asked, each seed's arms
  evaluated over its own sweep, and the report pooling the seeds."""
  from cmimem_jax.testing import run_tool
  from tests.test_documented_commands import REPO, documented_commands
  calls = []
  monkeypatch.setattr(reproduce, "reproduce", lambda config, workdir, stages,
                      pool, reuse, command, sweep=(), compare="": calls.append(
                          (os.path.relpath(workdir, tmp_path), config.seed,
                           config.rl.learning_rate, tuple(stages),
                           reuse and os.path.relpath(reuse, tmp_path),
                           tuple(os.path.relpath(d, tmp_path) for d in sweep),
                           tuple(os.path.relpath(d, tmp_path) for d in pool)))
                      or "report")
  written = [words for where, words in documented_commands()
             if where == "configs/small_repro.py"
             and words[2] == "tools.reproduce"]
  assert len(written) == 2
  rate = small_repro.get_config().rl.learning_rate
  grpo = ("grpo", "grpo_qa_only", "grpo_cmi_only")
  evaluations = ("eval_initial", "eval_warm_start", "eval_rl",
                 "eval_rl_qa_only", "eval_rl_cmi_only", "eval_equal_budget",
                 "report")
  expected = {
      0: [(".", 0, rate, ("teacher", "warm_start", *grpo), "", (), ()),
          (".", 0, rate, evaluations, "", (), ()),
          ("seed1", 1, rate, grpo, ".", (), ()),
          ("seed1", 1, rate, evaluations, ".", (), ()),
          (".", 0, rate, ("report",), "", (), ("seed1",))],
      1: [(".", 0, rate, ("teacher", "warm_start", *grpo), "", (), ()),
          ("lr3e-06", 0, 3e-6, grpo, ".", (), ()),
          ("lr3e-05", 0, 3e-5, grpo, ".", (), ()),
          (".", 0, rate, evaluations, "", ("lr3e-06", "lr3e-05"), ()),
          ("seed1", 1, rate, grpo, ".", (), ()),
          ("seed1/lr3e-06", 1, 3e-6, grpo, ".", (), ()),
          ("seed1/lr3e-05", 1, 3e-5, grpo, ".", (), ()),
          ("seed1", 1, rate, evaluations, ".",
           ("seed1/lr3e-06", "seed1/lr3e-05"), ()),
          (".", 0, rate, ("report",), "", ("lr3e-06", "lr3e-05"),
           ("seed1",))]}
  for n, words in enumerate(written):
    calls.clear()
    argv = [w.replace("--config=", f"--config={REPO}/", 1).replace(
        "--workdir=DIR", f"--workdir={tmp_path}") for w in words[3:]]
    run_tool(reproduce, argv)
    assert calls == expected[n], words
  # A listed stage runs in the named workdir alone, as before.
  calls.clear()
  run_tool(reproduce, [f"--config={REPO}/configs/small_repro.py",
                       f"--workdir={tmp_path}", "--stages=grpo"])
  assert calls == [(".", 0, rate, ("grpo",), "", (), ())]
  config = small_repro.get_config()
  config.repro.other_seeds = (0,)
  with pytest.raises(app.UsageError, match="besides"):
    reproduce.recipe_runs(config, str(tmp_path))
