# SPDX-License-Identifier: Apache-2.0
"""Writes schema/udp-fanout-config.schema.json (JSON Schema draft-07) from the rules below, which
follow Sources/FanoutCore/Config/ConfigParser.swift and the validation (ConfigValidation.swift and
each listener kind's validate), and from schema/settings-table.json for the listener settings:
python3 schema/generate-schema.py. The schema must never refuse a
file the daemon accepts; Tests/FanoutTests/ConfigSchemaTests.swift checks that."""
import json, os, sys

# ---- regular expressions (ECMA-262 and Python re compatible) ----
OCTET = r'(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])'          # inet_pton: no leading zeros
IPV4 = rf'{OCTET}(?:\.{OCTET}){{3}}'
H = r'[0-9A-Fa-f]{1,4}'
def ipv6():
    # Sound and a little lax: the group count around :: is not checked (inet_pton's is).
    v4tail = rf'(?:(?:{H}:){{1,6}}|(?:(?:{H}:){{1,5}}|:):(?:{H}:){{0,5}}){IPV4}'
    return rf'(?:(?:{H}:){{7}}{H}|(?:(?:{H}:){{1,7}}|:):(?:(?:{H}:){{0,6}}{H})?|{v4tail})'
IPV6 = ipv6()
# UInt16(text): an optional +, leading zeros; "-0" is 0 too.
PORT1 = r'\+?0*(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})'
PORT0 = rf'(?:[-+]?0+|{PORT1})'
def sockaddr(port):
    return rf'^(?:{IPV4}|\[{IPV6}\]):{port}$'
# ConfigParser.hostAndPort: lowercased labels of [a-z0-9_-] (not starting or ending with -), at least
# one letter, 1 to 63 characters each, at most 253 in all (a trailing dot aside). U+212A (Kelvin sign)
# lowercases to k.
LC = 'A-Za-z0-9_\u212a'
LABEL = rf'[{LC}](?:[{LC}-]{{0,61}}[{LC}])?'
DNS = rf'^(?=[^:]{{1,254}}:)(?=[^:]*[A-Za-z\u212a]){LABEL}(?:\.{LABEL})*\.?:{PORT1}$'
UNSPEC_V4 = r'^0\.0\.0\.0:'
UNSPEC_V6 = r'^\[[0:]*(?:0\.0\.0\.0)?\]:'
MCAST_V4 = r'^(?:22[4-9]|23[0-9])\.'
BCAST_V4 = r'^255\.255\.255\.255:'
MCAST_V6 = r'^\[[Ff][Ff][0-9A-Fa-f]{2}:'
CONTROL = r'[\x00-\x1f\x7f]'
BOOL_TEXT = r'^(?:[Tt][Rr][Uu][Ee]|[Ff][Aa][Ll][Ss][Ee]|[Yy][Ee][Ss]|[Nn][Oo]|[Oo][Nn]|[Oo][Ff][Ff])$'
INT_TEXT = r'^[-+_]*[0-9][-+_0-9A-Fa-fxXoObB]*$|:'
DNS_LABEL = r'^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$'
MAC = r'^[-+0-9A-Fa-f][0-9A-Fa-f](?::[-+0-9A-Fa-f][0-9A-Fa-f]){5}$'
PREFIX = rf'^(?:{IPV4}(?:/0*(?:3[0-2]|[12]?[0-9]))?|{IPV6}(?:/0*(?:12[0-8]|1[01][0-9]|[1-9]?[0-9]))?)$'
IFNAME = r'^[!-.0-~]{1,15}$'
HEX_OCTETS = r'^(?:[0-9A-Fa-f]{2}){1,15}$'
PATH = r'^/[^ ]*$'

def ref(name): return {'$ref': f'#/definitions/{name}'}

def octal_reading(v):
    """What a YAML 1.2 tool reads for the YAML 1.1 octal spelling of v (0144 is 100 to the daemon, 144 to them)."""
    return int(oct(v)[2:])

def integer(lo, hi, description, default=None):
    branches = [{'type': 'integer', 'minimum': lo, 'maximum': hi}]
    top = octal_reading(hi)
    if top > hi:
        branches.append({'type': 'integer', 'minimum': hi + 1, 'maximum': top,
                         'description': f'a 0-prefixed YAML 1.1 octal spelling (0{oct(hi)[2:]} is {hi} to the daemon), which YAML 1.2 tools read in decimal'})
    branches += [ref('integer-text'), ref('yaml-binary')]
    schema = {'description': description, 'anyOf': branches}
    if default is not None: schema['default'] = default
    return schema

def choice(values, description, default=None, yaml11_bool=False):
    enum = list(values) + ([True, False] if yaml11_bool else [])
    schema = {'description': description, 'anyOf': [{'enum': enum}, ref('yaml-binary')]}
    if default is not None: schema['default'] = default
    return schema

def boolean(description, default):
    return {'description': description, 'allOf': [ref('boolean')], 'default': default}

def text(description, definition='text'):
    return {'description': description, 'allOf': [ref(definition)]}

def powers(lo, hi):
    v = lo; out = []
    while v <= hi: out.append(v); v *= 2
    return out

definitions = {
    'json-value': {
        'description': 'Any JSON value: the values below are checked only when they are one. YAML loaders give bytes for a scalar tagged !!binary, which is no JSON type; the daemon reads such a scalar\'s text, so it is let through unchecked.',
        'type': ['null', 'boolean', 'object', 'array', 'number', 'string']},
    'text': {
        'description': 'Any scalar: the daemon reads its text (123, true and null are the strings "123", "true" and "null"); no control characters.',
        'anyOf': [{'type': 'string', 'not': {'pattern': CONTROL}}, {'type': ['number', 'boolean', 'null']}, ref('yaml-binary')]},
    'name': {
        'description': 'A non-empty scalar (read as text), no control characters.',
        'anyOf': [{'type': 'string', 'minLength': 1, 'not': {'pattern': CONTROL}}, {'type': ['number', 'boolean', 'null']}, ref('yaml-binary')]},
    'boolean': {
        'description': 'true or false; the daemon also takes yes/no and on/off (YAML 1.1), in any case, quoted or not.',
        'anyOf': [{'type': 'boolean'}, {'type': 'string', 'pattern': BOOL_TEXT}, ref('yaml-binary')]},
    'integer-text': {
        'description': 'A plain scalar that YAML 1.2 tools keep as a string but the daemon (YAML 1.1) reads as a whole number: sexagesimal (1:30 is 90), or one tagged !!str. Its range is checked by udp-fanout --check only. A quoted number is refused by the daemon.',
        'type': 'string', 'pattern': INT_TEXT},
    'listen-address': {
        'description': 'ip:port or [ipv6]:port, port 1-65535 (no scope: fe80::1%eth0 is refused).',
        'anyOf': [{'type': 'string', 'pattern': sockaddr(PORT1)}, ref('yaml-binary')]},
    'metrics-address': {
        'description': 'ip:port or [ipv6]:port (TCP).',
        'anyOf': [{'type': 'string', 'pattern': sockaddr(PORT0)}, ref('yaml-binary')]},
    'dns-address': {
        'description': 'dns-name:port: letters, digits, - and _ in dot-separated labels, at least one letter, an optional trailing dot; port 1-65535.',
        'type': 'string', 'pattern': DNS},
    'downstream-address': {
        'description': 'ip:port, [ipv6]:port (one host: not 0.0.0.0 or ::, not multicast, not 255.255.255.255; port 1-65535), or dns-name:port (every A/AAAA record becomes a downstream).',
        'anyOf': [
            ref('dns-address'),
            {'type': 'string', 'pattern': sockaddr(PORT1),
             'not': {'anyOf': [{'pattern': p} for p in (UNSPEC_V4, UNSPEC_V6, MCAST_V4, BCAST_V4, MCAST_V6)]}},
            ref('yaml-binary')]},
    'kubernetes-name': {
        'description': 'A DNS label: lowercase letters, digits and -, at most 63, not starting or ending with -.',
        'anyOf': [{'type': 'string', 'pattern': DNS_LABEL}, {'type': 'number', 'minimum': 0}, {'type': ['boolean', 'null']}, ref('yaml-binary')]},
    'kubernetes': {
        'description': 'EndpointSlice discovery: every ready endpoint of the Service becomes a downstream at port (docs/kubernetes.md). With downstream entries too, both are used (static entries first).',
        'type': 'object', 'additionalProperties': False, 'required': ['service', 'port'],
        'properties': {
            'namespace': {'description': "Namespace of the Service. Default: the pod's (in-cluster), the kubeconfig context's, else default.", 'allOf': [ref('kubernetes-name')]},
            'service': {'description': 'The Service whose EndpointSlices are watched (label kubernetes.io/service-name).', 'allOf': [ref('kubernetes-name')]},
            'port': integer(1, 65535, 'UDP port to send to on each ready endpoint.'),
        }},
    'downstream': {
        'description': 'One downstream: an address, or a DNS name whose every A/AAAA record is a downstream.',
        'type': 'object', 'additionalProperties': False, 'required': ['address'],
        'properties': {
            'name': text('Unique within the listener (or pool); the downstream label of metrics. Default: the address.'),
            'address': {'description': 'ip:port or [ipv6]:port (one host: not 0.0.0.0/::, not multicast or broadcast, port 1-65535, not a listener of this file), or dns-name:port: every A and AAAA record becomes a downstream named <name>/<ip>, re-resolved on the record\'s TTL (docs/dns.md). Scoped IPv6 (fe80::1%eth0) is refused.',
                        'allOf': [ref('downstream-address')]},
            'mac': {'description': "Legacy field of the reference: validated (six hex pairs separated by colons), then not used (the next hop's MAC comes from the kernel's neighbour table); a warning says so. Not with a DNS name.",
                    'anyOf': [{'type': 'string', 'pattern': MAC}, {'type': 'integer', 'minimum': 0, 'description': 'a MAC of decimal pairs such as 11:22:33:44:55:06 under a %YAML 1.1 directive, which YAML loaders read as a sexagesimal number'}, ref('yaml-binary')]},
            'weight': integer(0, 1_000_000, 'Share of the datagrams relative to the other downstreams; 0 takes it out of rotation. A DNS entry\'s weight applies to each of its addresses.', 1),
            'health_port': integer(1, 65535, "Where health probes go instead of the downstream's port (e.g. a UDP echo service next to the receiver)."),
            'server_id': {'description': "QUIC-LB: the server ID this server puts in the connection IDs it issues, as hexadecimal digits, two per octet (quic_lb's server_id_length octets; quote it). Required on every downstream given by address of a listener with quic_lb, distinct; refused elsewhere and with a DNS name (docs/quic.md).",
                          'anyOf': [{'type': 'string', 'pattern': HEX_OCTETS}, {'type': 'number', 'description': 'hexadecimal digits that YAML loaders read as a number (0102, 1e10)'}, ref('yaml-binary')]},
        },
        'allOf': [
            {'if': {'required': ['address'], 'properties': {'address': ref('dns-address')}},
             'then': {'not': {'anyOf': [{'required': ['mac']}, {'required': ['server_id']}]}}},
        ]},
    'quic-lb': {
        'description': 'One QUIC-LB configuration (draft-ietf-quic-load-balancers), as the QUIC servers behind the listener are configured.',
        'type': 'object', 'additionalProperties': False, 'required': ['server_id_length', 'nonce_length'],
        'properties': {
            'config_id': integer(0, 6, 'The config rotation codepoint: the top three bits of the connection IDs of this configuration (7 is reserved for unroutable IDs).', 0),
            'server_id_length': integer(1, 15, 'Octets of server ID after the first octet of a connection ID; every configuration of a listener has the same.'),
            'nonce_length': integer(4, 18, 'Octets of nonce after the server ID; server ID and nonce together at most 19.'),
            'key': {'description': 'The AES-128 key (32 hexadecimal digits): server IDs are encrypted (single-pass when server ID and nonce make 16 octets, four-pass otherwise). Without key or key_file they are plaintext.',
                    'anyOf': [{'type': 'string', 'pattern': r'^[0-9A-Fa-f]{32}$'}, {'type': 'number'}, ref('yaml-binary')]},
            'key_file': {'description': 'A file holding the key as 32 hexadecimal digits (whitespace ignored), read at start and at each reload; instead of key.', 'allOf': [ref('text')]},
        },
        'not': {'required': ['key', 'key_file']}},
    'rate-limit': {
        'description': 'Token buckets per source prefix (docs/abuse.md): a datagram above its prefix\'s rates, or from a new source above new_sources_per_second, is dropped and counted rate_limited. Every mode. Changing it restarts the listener (its buckets start full).',
        'type': 'object', 'additionalProperties': False,
        'anyOf': [{'required': ['datagrams_per_second']}, {'required': ['bytes_per_second']}, {'required': ['new_sources_per_second']}],
        'properties': {
            'datagrams_per_second': integer(1, 1_000_000_000, 'Datagrams a source prefix may send per second.'),
            'burst_datagrams': integer(1, 1_000_000_000, 'Datagrams a source prefix may send at once (only with datagrams_per_second). Default: a tenth of datagrams_per_second, at least 5.'),
            'bytes_per_second': integer(1, 1_000_000_000_000, 'UDP payload bytes a source prefix may send per second.'),
            'burst_bytes': integer(1, 1_000_000_000_000, 'Bytes a source prefix may send at once (only with bytes_per_second); below settings.max_packet_size is warned about. Default: a tenth of bytes_per_second, at least 65535.'),
            'ipv4_prefix': integer(8, 32, 'Bits of an IPv4 source (and of an IPv4-mapped IPv6 one) that make its bucket.', 32),
            'ipv6_prefix': integer(16, 128, 'Bits of an IPv6 source that make its bucket (a /64 is one host\'s usual allocation).', 64),
            'allow': {'description': 'Sources never limited, nor counted as new (at most 256 prefixes).',
                      'type': 'array', 'maxItems': 256, 'items': {'description': 'A client prefix: 198.18.0.0/16, 2001:db8::/32, or a bare address.',
                                                                 'anyOf': [{'type': 'string', 'pattern': PREFIX}, ref('yaml-binary')]}},
            'new_sources_per_second': integer(1, 100_000_000, 'Sources the listener starts tracking per second; a datagram of a new source above it is dropped.'),
            'burst_new_sources': integer(1, 100_000_000, 'New sources at once (only with new_sources_per_second). Default: a tenth, at least 5.'),
            'max_sources': integer(1024, 16_777_216, 'Source prefixes tracked at once (userspace kinds: a table shared by the workers; tc_ebpf and xdp: an LRU map).', 65536),
        },
        'allOf': [
            {'if': {'not': {'required': ['datagrams_per_second']}}, 'then': {'not': {'required': ['burst_datagrams']}}},
            {'if': {'not': {'required': ['bytes_per_second']}}, 'then': {'not': {'required': ['burst_bytes']}}},
            {'if': {'not': {'required': ['new_sources_per_second']}}, 'then': {'not': {'required': ['burst_new_sources']}}},
        ]},
    'amplification': {
        'description': 'Two-way listeners (replies nat or relay): the bytes sent back to a client not yet validated are at most factor times the bytes received from it; replies beyond are dropped and counted amplification_capped (docs/abuse.md). Changing it restarts the listener.',
        'type': 'object', 'additionalProperties': False,
        'properties': {
            'factor': integer(1, 1000, 'Bytes back per byte received, until the client is validated.', 3),
            'validated_after': integer(0, 1_000_000, 'Exchanges (a datagram of the client after a reply was sent to it) that validate a client, lifting the cap; 0: none does.', 0),
        }},
    'downstreams': {
        'description': 'Downstreams: required (non-empty) unless kubernetes is configured. Entries given by DNS name are resolved into downstreams.',
        'type': 'array', 'items': ref('downstream')},
    'members-required': {
        'description': 'Without kubernetes discovery, at least one downstream, and one that can take datagrams (weight above 0, or a DNS name).',
        'if': {'not': {'required': ['kubernetes']}},
        'then': {'required': ['downstream'], 'properties': {'downstream': {
            'minItems': 1,
            'contains': {'anyOf': [
                {'not': {'required': ['weight']}},
                {'properties': {'weight': {'not': {'const': 0}}}},
                {'required': ['address'], 'properties': {'address': ref('dns-address')}}]}}}}},
    'pool': {
        'description': 'A replication pool: each datagram the listener receives also goes to it (docs/replication.md).',
        'type': 'object', 'additionalProperties': False, 'required': ['name'],
        'properties': {
            'name': {'description': 'Unique within the listener, not default (the name of the listener\'s own downstreams); the pool label of metrics.',
                     'allOf': [ref('name'), {'not': {'const': 'default'}}]},
            'balancing': choice(['round_robin', 'source_ip', 'all'], 'One member per datagram, as the listener\'s balancing (the same table), or all: every member gets a copy.', 'round_robin'),
            'downstream': {'description': "The pool's members, as the listener's downstream.", 'allOf': [ref('downstreams')]},
            'kubernetes': {'description': "EndpointSlice discovery of the pool's members, as the listener's.", 'allOf': [ref('kubernetes')]},
            'sample': integer(1, 1_000_000, 'One source in N: every datagram of the sources whose address hashes to this pool\'s share; the others are counted sampled_out.', 1),
            'sources': {'description': 'Only clients in these prefixes go to the pool (an IPv4-mapped client counts as its IPv4 address); the others are counted filtered_out. A prefix with bits set past its length is refused.',
                        'type': 'array', 'items': {'description': 'A client prefix: 198.18.0.0/16, 2001:db8::/32, or a bare address.',
                                                   'anyOf': [{'type': 'string', 'pattern': PREFIX}, {'type': 'integer', 'minimum': 0, 'description': 'an IPv6 address of decimal groups (1:2:3:4:5:6:7:8) under a %YAML 1.1 directive, read as a sexagesimal number'}, ref('yaml-binary')]}},
            'output': choice(['socket', 'preserve_source'], "How the pool's copies leave. Default: the listener's settings.output; tc_ebpf and xdp always keep the client's source (socket is refused there)."),
        },
        'allOf': [ref('members-required')]},
}

def setting(key):
    """The schema of one listener setting, from its declaration in the settings table."""
    doc, default = key['doc'], key['default']
    if key['type'] == 'boolean':
        return boolean(doc, default)
    if key['type'] == 'choice':
        # A word YAML 1.1 reads as a boolean (on, off) is one to YAML 1.2 tools too.
        return choice(key['values'], doc, default, yaml11_bool=any(v in ('on', 'off', 'yes', 'no') for v in key['values']))
    if key['type'] == 'interface_names':
        return {'description': doc,
                'type': 'array', 'items': {'description': 'An interface name: 1 to 15 printable ASCII characters, no / or space.',
                                           'anyOf': [{'type': 'string', 'pattern': IFNAME}, {'type': ['number', 'boolean', 'null']}, ref('yaml-binary')]}}
    assert key['type'] == 'integer', key
    lo, hi = key['minimum'], key['maximum']
    if key.get('power_of_two'):
        values = powers(lo, hi)
        low = values[0]
        spelled = f'0{oct(low)[2:]} is {low}'
    elif 'values' in key:
        values = key['values']
        low = values[0]
        spelled = f'0{oct(low)[2:]} is {low}'
    else:
        return integer(lo, hi, doc, default)
    octal = {'enum': [octal_reading(v) for v in values],
             'description': f'0-prefixed YAML 1.1 octal spellings ({spelled} to the daemon), read in decimal by YAML 1.2 tools'}
    return {'description': doc, 'default': default, 'anyOf': [{'enum': values}, octal, ref('integer-text'), ref('yaml-binary')]}

# The settings are declared in the daemon, beside the kind that owns each (SettingKey); schema/settings-table.json is
# their dump (udp-fanout --print-settings-table), checked by SettingsTableTests to be the daemon's.
TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'settings-table.json')
settings = {
    'type': 'object', 'additionalProperties': False,
    'description': 'Per-listener tuning. Keys that have no effect in the listener\'s mode are warned about by name, not refused.',
    'properties': {key['name']: setting(key) for key in json.load(open(TABLE))['settings']}}

def mode_is(*modes): return {'required': ['mode'], 'properties': {'mode': {'enum': list(modes)}}}
def settings_key_is(key, *values): return {'required': ['settings'], 'properties': {'settings': {'required': [key], 'properties': {key: {'enum': list(values)}}}}}

ring_clauses = []
for v in powers(64, 16384):
    for seen in sorted({v, octal_reading(v)}):
        ring_clauses.append({
            'if': {'allOf': [mode_is('af_xdp'), settings_key_is('ring_size', seen)]},
            'then': {'properties': {'settings': {'properties': {'umem_frames': {'minimum': 2 * v}}}}}})

UNSPECIFIED_BIND = {'anyOf': [{'pattern': UNSPEC_V4}, {'pattern': UNSPEC_V6}]}
V4_LITERAL = r'^[0-9]+(?:\.[0-9]+){3}:'
V6_LITERAL = r'^\['
LOOPBACK = r'^127\.|^\[[0:]*:0*1\]:'
BIND_V4 = {'required': ['bind'], 'properties': {'bind': {'type': 'string', 'pattern': V4_LITERAL}}}
BIND_V6 = {'required': ['bind'], 'properties': {'bind': {'type': 'string', 'pattern': V6_LITERAL}}}
NOT_WILDCARD = {'properties': {'bind': {'not': UNSPECIFIED_BIND}}}
def own_members_not(pattern):
    return {'properties': {'downstream': {'items': {'properties': {'address': {'not': {'pattern': pattern}}}}}}}
def pool_members_not(pattern, condition=None):
    item = own_members_not(pattern)
    if condition is not None: item = {'if': condition, 'then': item}
    return {'properties': {'pools': {'items': item}}}
def members_not(pattern): return {'allOf': [own_members_not(pattern), pool_members_not(pattern)]}
POOL_PRESERVES = {'required': ['output'], 'properties': {'output': {'const': 'preserve_source'}}}
POOL_INHERITS = {'not': {'required': ['output']}}
family_clauses = []
for bind, other in ((BIND_V4, V6_LITERAL), (BIND_V6, V4_LITERAL)):
    # tc_ebpf and xdp rewrite the destination in place: every static downstream of the bind's family.
    family_clauses.append({'if': {'allOf': [mode_is('tc_ebpf', 'xdp'), bind]}, 'then': members_not(other)})
    # A way out that keeps the client's source (the listener's output, or a pool's) cannot reach the other family.
    family_clauses.append({'if': {'allOf': [bind, NOT_WILDCARD, settings_key_is('output', 'preserve_source', 'xdp_tx')]},
                           'then': {'allOf': [own_members_not(other), pool_members_not(other, POOL_INHERITS)]}})
    family_clauses.append({'if': {'allOf': [bind, NOT_WILDCARD]}, 'then': pool_members_not(other, POOL_PRESERVES)})
listener = {
    'type': 'object', 'additionalProperties': False, 'required': ['name', 'bind'],
    'properties': {
        'name': {'description': 'Unique; the listener label of every metric.', 'allOf': [ref('name')]},
        'bind': {'description': "Where datagrams arrive: ip:port or [ipv6]:port, port 1-65535; must not overlap another listener's bind.", 'allOf': [ref('listen-address')]},
        'interface': text('The network interface for tc_ebpf, xdp and af_xdp (required with them); warned about in userspace.'),
        'mode': choice(['userspace', 'tc_ebpf', 'xdp', 'af_xdp'], 'Forwarding path (docs/udp-fanout.md, docs/af_xdp.md). At most one af_xdp listener per interface; xdp and af_xdp listeners cannot share one.', 'userspace'),
        'balancing': choice(['round_robin', 'source_ip'], 'round_robin: each datagram to the next downstream, in proportion to weights. source_ip: every datagram of one source address to one downstream (the same choice on every node with the same downstreams).', 'round_robin'),
        'replies': choice(['none', 'nat', 'relay'], 'One way (none), or a two-way load balancer: nat (tc_ebpf and xdp; bind must be the virtual address, not a wildcard; docs/two-way-nat.md) or relay (userspace only, output: socket, worker_steering five_tuple or source_ip; docs/two-way-relay.md).', 'none'),
        'downstream': {'description': 'Downstreams: required (non-empty) unless kubernetes is configured. Entries given by DNS name are resolved into downstreams.', 'allOf': [ref('downstreams')]},
        'kubernetes': ref('kubernetes'),
        'settings': settings,
        'pools': {'description': "Replication (docs/replication.md): each datagram the listener receives also goes to each pool; the listener's own downstream list is its first pool (named default). tc_ebpf and xdp: at most 8 per listener.",
                  'type': 'array', 'items': ref('pool')},
        'quic_lb': {'description': "QUIC-LB (docs/quic.md): each datagram goes to the downstream whose server_id its QUIC destination connection ID carries; balancing chooses for client-chosen and unknown IDs. One configuration, or a list of them with distinct config_id (a key rotation). Every mode; in tc_ebpf and xdp a key needs the kernel's BPF crypto kfuncs (Linux 6.10+).",
                    'anyOf': [ref('quic-lb'), {'type': 'array', 'minItems': 1, 'items': ref('quic-lb')}]},
        'rate_limit': ref('rate-limit'),
        'amplification': ref('amplification'),
    },
    'allOf': [
        ref('members-required'),
        {'if': mode_is('tc_ebpf', 'xdp', 'af_xdp'),
         'then': {'required': ['interface'], 'properties': {'interface': {'not': {'const': ''}}}}},
        {'if': {'required': ['replies'], 'properties': {'replies': {'const': 'nat'}}},
         'then': {'required': ['mode'], 'properties': {'mode': {'not': {'enum': ['userspace', 'af_xdp']}}, 'bind': {'not': UNSPECIFIED_BIND}}}},
        {'if': {'required': ['replies'], 'properties': {'replies': {'const': 'relay'}}},
         'then': {'properties': {'mode': {'not': {'enum': ['tc_ebpf', 'xdp', 'af_xdp']}},
                                 'settings': {'properties': {'output': {'not': {'enum': ['preserve_source', 'xdp_tx']}},
                                                             'worker_steering': {'not': {'const': 'round_robin'}}}}}}},
        {'if': {'anyOf': [{'not': {'required': ['replies']}}, {'properties': {'replies': {'const': 'none'}}}]},
         'then': {'not': {'required': ['amplification']}}},
        {'if': {'anyOf': [{'not': {'required': ['mode']}}, mode_is('userspace')]},
         'then': {'properties': {'settings': {'properties': {'output': {'not': {'const': 'xdp_tx'}}}}}}},
        {'if': mode_is('tc_ebpf', 'xdp'), 'then': members_not(LOOPBACK)},
        {'if': mode_is('tc_ebpf', 'xdp'),
         'then': {'properties': {'settings': {'properties': {'output': {'not': {'enum': ['socket', 'xdp_tx']}}}},
                                 'pools': {'maxItems': 8, 'items': {'properties': {'output': {'not': {'const': 'socket'}}}}}}}},
        {'if': {'allOf': [mode_is('af_xdp'), settings_key_is('xdp_mode', 'generic')]},
         'then': {'properties': {'settings': {'properties': {'zero_copy': {'not': {'enum': ['on', True]}}}}}}},
        {'if': {'allOf': [mode_is('af_xdp'), {'not': {'required': ['settings'], 'properties': {'settings': {'required': ['ring_size']}}}}]},
         'then': {'properties': {'settings': {'properties': {'umem_frames': {'minimum': 4096}}}}}},
        {'if': {'allOf': [mode_is('af_xdp'), {'not': {'required': ['settings'], 'properties': {'settings': {'required': ['umem_frames']}}}}]},
         'then': {'properties': {'settings': {'properties': {'ring_size': {'not': {'enum': [v for v in powers(4096, 16384)] + [octal_reading(v) for v in powers(4096, 16384)]}}}}}}},
    ] + family_clauses + ring_clauses,
}

health = {
    'type': 'object', 'additionalProperties': False,
    'description': 'Active health checks of every downstream, static and discovered (docs/health.md).',
    'properties': {
        'enabled': boolean('Probe every downstream, each on its own schedule. The other keys are warned about while this is false.', False),
        'interval_secs': integer(1, 3600, 'Time between two probes of one downstream.', 5),
        'timeout_secs': integer(1, 3600, 'How long a probe waits; at most interval_secs.', 2),
        'protocol': choice(['icmp', 'udp_echo'], "ICMP echo to the downstream's address, or a UDP datagram to its port (or health_port) that must come back byte for byte.", 'icmp'),
        'rise': integer(1, 100, 'Consecutive successful probes that bring a downstream back.', 1),
        'fall': integer(1, 100, 'Consecutive failed probes that take a downstream out.', 3),
    },
    'allOf': [
        {'if': {'not': {'required': ['interval_secs']}}, 'then': {'properties': {'timeout_secs': {'maximum': 5}}}},
        {'if': {'not': {'required': ['timeout_secs']}}, 'then': {'properties': {'interval_secs': {'minimum': 2}}}},
    ] + [
        # Both set: the common intervals (a YAML 1.1 octal timeout such as 010, 8 to the daemon, reads 10 here).
        {'if': {'required': ['interval_secs'], 'properties': {'interval_secs': {'const': v}}},
         'then': {'properties': {'timeout_secs': {'maximum': octal_reading(v)}}}}
        for v in list(range(1, 11)) + [15, 20, 30, 60]
    ]}

metrics = {
    'type': 'object', 'additionalProperties': False,
    'description': 'The HTTP endpoint: Prometheus text, /healthz and /readyz.',
    'properties': {
        'enabled': boolean('Serve /metrics (or path), /status, /healthz, /readyz and /associations.', False),
        'bind': {'description': 'TCP address of the endpoint. Default 127.0.0.1:9090 (loopback); 0.0.0.0:9090, [::]:9090 or the pod IP let scrapers and kubelets on other hosts reach it.', 'default': '127.0.0.1:9090', 'allOf': [ref('metrics-address')]},
        'path': {'description': 'Path of the Prometheus text: starts with /, no spaces.', 'default': '/metrics',
                 'anyOf': [{'type': 'string', 'pattern': PATH, 'not': {'pattern': CONTROL}}, ref('yaml-binary')]},
    }}

# Only values whose 0-prefixed (YAML 1.1 octal) spelling the daemon refuses too: 253, 255, 11, 12
# and 42 spelled 0253... are other numbers to the daemon, which it accepts.
RESERVED_PROTOCOLS = [1, 2, 3, 4] + list(range(186, 199))
announce = {
    'type': 'object', 'additionalProperties': False, 'required': ['addresses'],
    'description': 'Virtual addresses published to the node\'s routing daemon (BIRD, FRR) as host routes while every listener receiving on them is ready; a stop or a drain withdraws them first (docs/fleet.md).',
    'properties': {
        'addresses': {'description': 'Each announced as a /32 or /128 route; a listener must receive on it (bound to it or to its family\'s wildcard). Unicast, not loopback, listed once.',
                      'type': 'array', 'minItems': 1,
                      'items': {'type': 'string', 'pattern': rf'^(?:{IPV4}|{IPV6})$'}},
        'table': dict(integer(1, 4294967295, 'The kernel routing table the routes are kept in (not 253 or 255); main (254) for FRR nodes (docs/fleet.md).', 201),
                      ),
        'protocol': dict(integer(1, 255, 'The routes\' protocol number: what the routing daemon selects them by. Not the kernel\'s (1-4) or a routing daemon\'s own (11, 12, 42, 186-198).', 201),
                         **{'not': {'enum': RESERVED_PROTOCOLS}}),
        'drain_secs': integer(0, 300, 'How long a stop or a drain (udp-fanout drain, SIGUSR2) keeps serving after the withdrawal.', 5),
    }}

schema = {
    '$schema': 'http://json-schema.org/draft-07/schema#',
    'title': 'udp-fanout configuration',
    '$comment': 'Never stricter than the daemon (Tests/FanoutTests/ConfigSchemaTests.swift checks it on the reliability suite\'s mutated files). Generated by schema/generate-schema.py. The daemon reads YAML 1.1 (Yams), YAML tools here read YAML 1.2: hence the extra branches for yes/no/on/off booleans, sexagesimal and !!str numbers (integer-text), 0-prefixed octal numbers (read in decimal here, so a range reaches up to the octal spelling of its maximum read in decimal) and !!binary scalars (bytes: json-value).',
    'description': 'The YAML configuration of udp-fanout (docs/configuration.md). Never stricter than the daemon: every file `udp-fanout --check` accepts passes; the daemon also checks what a schema cannot (duplicate names, overlapping binds, forwarding loops, interfaces, address families, limits across listeners), so `udp-fanout --check -c FILE` stays the authority.',
    'type': 'object', 'additionalProperties': False, 'required': ['listeners'],
    'properties': {
        'listeners': {'description': 'One entry per listening socket; at least one.', 'type': 'array', 'minItems': 1, 'items': listener},
        'health': health,
        'metrics': metrics,
        'announce': announce,
    },
    'definitions': definitions,
}
BIN = ref('yaml-binary')
def lift_binary(node):
    """anyOf [..., yaml-binary] becomes if json-value then anyOf [...]: clearer errors than a failed not."""
    if isinstance(node, list): return [lift_binary(x) for x in node]
    if not isinstance(node, dict): return node
    for k in list(node): node[k] = lift_binary(node[k])
    # Choices and booleans keep anyOf: editors complete their values from it.
    completable = 'anyOf' in node and any('enum' in b or b.get('type') == 'boolean' for b in node['anyOf'])
    if 'anyOf' in node and BIN in node['anyOf'] and completable:
        node['anyOf'] = [b if b != BIN else {'not': ref('json-value')} for b in node['anyOf']]
    elif 'anyOf' in node and BIN in node['anyOf']:
        assert 'if' not in node and 'then' not in node
        branches = [b for b in node.pop('anyOf') if b != BIN]
        node['if'] = ref('json-value')
        node['then'] = branches[0] if len(branches) == 1 else {'anyOf': branches}
    return node
schema = lift_binary(schema)
assert 'yaml-binary' not in json.dumps(schema)
out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), 'udp-fanout-config.schema.json')
def dumps(value, indent=0, width=110):
    flat = json.dumps(value, ensure_ascii=False)
    if len(flat) + indent <= width or not isinstance(value, (dict, list)) or not value:
        return flat
    pad = ' ' * (indent + 2)
    if isinstance(value, dict):
        items = [pad + json.dumps(k, ensure_ascii=False) + ': ' + dumps(v, indent + 2, width) for k, v in value.items()]
        return '{\n' + ',\n'.join(items) + '\n' + ' ' * indent + '}'
    items = [pad + dumps(v, indent + 2, width) for v in value]
    return '[\n' + ',\n'.join(items) + '\n' + ' ' * indent + ']'
with open(out, 'w') as f:
    f.write(dumps(schema) + '\n')
assert json.load(open(out)) == schema
print('wrote', out)
