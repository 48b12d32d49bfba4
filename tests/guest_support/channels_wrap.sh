#!/bin/sh
# Runs "$@" (a guest agent) in the private mount namespace `unshare -m` gave it, with a
# tmpfs on /dev (made again: null, zero, random, urandom, fd) and $1 bind-mounted over
# /proc/devices: the agent keeps IMEX channel nodes there with its fixed paths, and the
# host's /dev is never touched (tests/e2e/test_barrier.py). Everything goes with the
# namespace when the agent exits.
set -eu
devices=$1
shift
mount -t tmpfs -o mode=0755 tmpfs /dev
mknod -m 666 /dev/null c 1 3
mknod -m 666 /dev/zero c 1 5
mknod -m 666 /dev/random c 1 8
mknod -m 666 /dev/urandom c 1 9
ln -s /proc/self/fd /dev/fd
mount --bind "$devices" /proc/devices
exec "$@"
