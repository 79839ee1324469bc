"""One module per scorer; each docstring gives its formula and inputs."""
