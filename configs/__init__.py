"""Line configs and CoE model specs, shipped with the package so `--line A` works anywhere."""
