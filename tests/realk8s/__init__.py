"""Tests against a real kube-apiserver, etcd, kube-controller-manager and CoreDNS."""
