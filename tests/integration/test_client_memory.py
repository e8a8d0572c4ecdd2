"""The client never holds the training state: its peak RSS does not follow model size."""

from tests.conftest import run_cli

SMALL = ["base_emb_dim=32", "base_mlp_dim=64", "base_num_decoder_layers=2", "vocab_size=64"]
# ~10M parameters: params + Adam moments are ~120 MB on each worker.
LARGE = ["base_emb_dim=384", "base_mlp_dim=1536", "base_num_decoder_layers=4", "vocab_size=4096"]
COMMON = ["steps=2", "dcn_data_parallelism=2", "ici_fsdp_parallelism=1", "elastic_microbatches=2",
          "per_device_batch_size=1"]


def test_client_peak_rss_does_not_grow_with_model_size(tmp_path):
    _, small = run_cli(["run", "tiny", *COMMON, *SMALL, "run_name=small"], tmp_path / "s")
    _, large = run_cli(["run", "tiny", *COMMON, *LARGE, "run_name=large"], tmp_path / "l")
    assert large["state_bytes"] > 200 * small["state_bytes"]
    growth = large["client_peak_rss_bytes"] - small["client_peak_rss_bytes"]
    # Had the client materialized the state once, it would have grown by state_bytes.
    mib = lambda report, key: f"{report[key] / 2**20:.0f} MiB"
    print(f"\nclient peak RSS {mib(small, 'client_peak_rss_bytes')} (small), {mib(large, 'client_peak_rss_bytes')} "
          f"(large); state {mib(large, 'state_bytes')}")
    assert growth < 0.25 * large["state_bytes"], (growth, large["state_bytes"])
