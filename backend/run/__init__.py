"""The run folder: the contract between the process that trains and those that watch it, and the requests they
send a live run."""
