"Experiment tracking as users organise it: MLflow experiment, run name and tags from the flags; evaluate.py logs into the run it evaluates."
import json, sys

import pytest

from conftest import run

mlflow = pytest.importorskip('mlflow')


def test_train_sample_evaluate_resume_one_mlflow_run(tmp_path):
    """Training, sampling, evaluation and a resumed launch all land in one MLflow run. MLflow refuses to change a logged
    parameter: the resume with other flags continues the run, and the new values stand as `changed_on_resume/` tags."""
    uri = f"sqlite:///{tmp_path/'mlruns.db'}"
    out = tmp_path/'ldm'
    args = [sys.executable, 'scripts/train_ldm.py', '--output_dir', str(out), '--dataset', 'shapes:n=16', '--train_batch_size', '4',
            '--report_to', 'mlflow', '--tracking_uri', uri, '--experiment', 'shapes-ldm', '--run_name', 'tiny-a',
            '--tags', 'phase=pretrain,resolution=32', '--block_out_channels', '32,32', '--text_hidden', '32', '--checkpointing_steps', '2']
    run(args + ['--max_train_steps', '2', '--learning_rate', '1e-4'])
    run([sys.executable, 'scripts/sample.py', '--model', str(out/'model'), '--shapes_split', 'test', '--n', '4', '--steps', '2',
         '--out', str(tmp_path/'samples')])
    p = run([sys.executable, 'scripts/evaluate.py', '--samples', str(tmp_path/'samples'), '--feature', 'random', '--vae', ''])
    run_id = json.loads((out/'tracker.json').read_text())['run_id']
    assert f"MLflow run {run_id}" in p.stdout, p.stdout
    run(args + ['--max_train_steps', '3', '--learning_rate', '2e-4', '--validation_steps', '1000'])   # the same run, resumed with other flags
    assert json.loads((out/'tracker.json').read_text())['run_id'] == run_id
    client = mlflow.tracking.MlflowClient(uri)
    exp = client.get_experiment_by_name('shapes-ldm')
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    r = runs[0]
    assert r.info.artifact_uri.startswith((tmp_path/'mlartifacts').as_uri())   # beside the store, not in ./mlruns
    assert r.info.run_name == 'tiny-a' and r.data.tags['phase'] == 'pretrain' and r.data.tags['resolution'] == '32'
    assert r.data.params['config/model/block_out_channels'] == '[32, 32]' and r.data.params['config/data/dataset'] == 'shapes:n=16'
    hist = client.get_metric_history(run_id, 'eval/oracle/color_and_shape')
    assert [m.step for m in hist] == [2] and 0 <= hist[0].value <= 1
    metrics = json.loads((tmp_path/'samples'/'metrics.json').read_text())
    assert hist[0].value == pytest.approx(metrics['oracle/color_and_shape'])
    assert r.data.params['config/train/lr'] == '0.0001' and r.data.params['config/train/max_steps'] == '2'   # the first launch's
    assert r.data.tags['changed_on_resume/config/train/lr'] == '0.0002' and r.data.tags['changed_on_resume/config/train/max_steps'] == '3'
    assert not any(k.startswith('changed_on_resume/config/model') for k in r.data.tags)     # unchanged values are not repeated
    assert [m.step for m in client.get_metric_history(run_id, 'loss')] == [2, 3]                 # one curve across both launches
