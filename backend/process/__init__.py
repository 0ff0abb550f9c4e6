"""How PipeTrain's own processes start: their command lines, DeepSpeed's launcher, diffusion-pipe's command line,
several machines, and children that end with their parent."""
