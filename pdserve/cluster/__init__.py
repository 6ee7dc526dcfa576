"""The control plane: the `pdserve` command line, `serve` on one host, placement and its
checks, the Ray launcher and Ray-side processes, `up`/`down`/`status`/`scale`."""
