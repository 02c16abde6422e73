# Sourced by the integration tests that need two "hosts": two network namespaces joined by a
# veth pair (the rendezvous's host key includes the network namespace, so each is a host).
#
#   two_hosts_up TAG SUBNET   makes namespaces tp_TAG_a_$$ / tp_TAG_b_$$ and the pair
#                             tpTAGa$$ / tpTAGb$$ (TAG: 2-3 letters), addresses SUBNET.1 and
#                             SUBNET.2 (/24), loopback up; sets HOST_A, HOST_B, ADDR_A,
#                             ADDR_B. Exits 77 (skipped) where namespaces cannot be made.
#   two_hosts_down            removes them (idempotent; for the caller's EXIT trap).
two_hosts_down() {
  [ -n "${HOST_A:-}" ] && ip netns del "$HOST_A" 2>/dev/null
  [ -n "${HOST_B:-}" ] && ip netns del "$HOST_B" 2>/dev/null
  [ -n "${VETH_A:-}" ] && ip link del "$VETH_A" 2>/dev/null
  true
}

two_hosts_up() {
  local tag=$1 subnet=$2 err
  HOST_A=tp_${tag}_a_$$
  HOST_B=tp_${tag}_b_$$
  VETH_A=tp${tag}a$$
  VETH_B=tp${tag}b$$
  ADDR_A=$subnet.1
  ADDR_B=$subnet.2
  if ! err=$(ip netns add "$HOST_A" 2>&1 && ip netns add "$HOST_B" 2>&1); then
    echo "SKIPPED: cannot create network namespaces here: $err"
    two_hosts_down
    exit 77
  fi
  ip link add "$VETH_A" type veth peer name "$VETH_B" &&
    ip link set "$VETH_A" netns "$HOST_A" &&
    ip link set "$VETH_B" netns "$HOST_B" &&
    ip -n "$HOST_A" addr add "$ADDR_A/24" dev "$VETH_A" &&
    ip -n "$HOST_B" addr add "$ADDR_B/24" dev "$VETH_B" &&
    ip -n "$HOST_A" link set lo up &&
    ip -n "$HOST_B" link set lo up &&
    ip -n "$HOST_A" link set "$VETH_A" up &&
    ip -n "$HOST_B" link set "$VETH_B" up || {
    echo "FAILED: cannot join the namespaces with a veth pair"
    two_hosts_down
    exit 1
  }
  ip netns exec "$HOST_A" ping -c1 -W2 "$ADDR_B" >/dev/null 2>&1 || true
}
