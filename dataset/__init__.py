"""Prepared datasets: reading corpora, tokenizing them into shards, and sampling training
windows from any source (docs/data.md). `format` is torch- and numpy-free: the controller
reads manifests at admission."""
