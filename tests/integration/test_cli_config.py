"""``elastic run`` of a user's own config file: bundled names in ``base_config``, and a terminal that holds
only what the user needs (no XLA log lines: asking whether the file is MaxText's must not import MaxText,
whose package lowers the C++ log level of the whole process)."""


def test_a_users_file_on_a_bundled_config_runs_with_only_the_summary_on_the_terminal(cli, tmp_path):
    (tmp_path / "mine.yml").write_text("base_config: tiny\nsteps: 2\ndcn_data_parallelism: 2\n"
                                       "ici_fsdp_parallelism: 1\nelastic_microbatches: 2\n"
                                       "elastic_standby_workers: 0\nrun_name: mine\n")
    proc, report = cli("run", "mine.yml")
    assert report["steps_completed"] == 2
    assert (report["config"]["learning_rate"], report["config"]["base_emb_dim"]) == (0.003, 32)   # tiny's
    assert proc.stderr == "", proc.stderr
    assert "PjRt" not in proc.stdout
    assert proc.stdout.rstrip().endswith(f"report: {(tmp_path / 'mine' / 'report.html').resolve().as_uri()}")
