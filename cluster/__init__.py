"""The control plane: the `pdserve` command line, the cluster file, placement and its checks,
the Ray launcher, `serve`/`up`/`down`/`status`/`scale`."""
