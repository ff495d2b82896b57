#!/bin/sh
# Stand-in for NGC's /opt/nvidia/nvidia_entrypoint.sh (driver check, CUDA forward compatibility, banner): the
# stand-in base has no GPU stack, so it runs the command as given.
exec "$@"
