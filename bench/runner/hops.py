"""hops.py - the client and the report of bench/runner/hops.sh.

  hops.py run URL ORG_TOKEN N   one sandbox, N `true` commands one at a
                                time (after 5 unmeasured), as JSON
  hops.py report DIR            each hop's p50/p90 from DIR's logs
"""
import datetime
import http.client
import json
import re
import statistics
import sys
import time
import urllib.parse

ANSI = re.compile(r'\x1b\[[0-9;]*m')
HOPS = [
    # (label, where the hop ends)
    ('POST answered (client)', 'client posted'),
    ('runner has the assignments', 'assignments read'),
    ('command task started', 'command task started'),
    ('agent incarnation read (LIST)', 'agent incarnation read'),
    ('launch record fsynced', 'launch recorded'),
    ('started in the agent (RUN → STARTED)', 'started in the agent'),
    ('`running` reported (a command still running after 5 ms)', 'reported running'),
    ('ended in the agent', 'ended in the agent'),
    ('end reported', 'reported exited'),
    ('client long-poll answered', 'client ended'),
]


def run(url, token, n):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port)
    headers = {'authorization': 'Bearer ' + token, 'content-type': 'application/json'}

    def call(method, path, body=None):
        conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        answer = conn.getresponse()
        data = answer.read()
        return json.loads(data) if data else None

    sandbox = call('POST', '/v1/sandboxes', {'image': 'default', 'storage_class': 'standard', 'network': 'none'})
    while sandbox['state'] != 'running':
        sandbox = call('GET', f"/v1/sandboxes/{sandbox['id']}?wait_for=running&timeout=25")
    out = []
    for i in range(n + 5):
        t0 = time.time()
        command = call('POST', f"/v1/sandboxes/{sandbox['id']}/commands", {'argv': ['true']})
        posted = time.time()
        while command.get('ended_at') is None:
            command = call('GET', f"/v1/sandboxes/{sandbox['id']}/commands/{command['id']}?wait_for=ended&timeout=25")
        if i >= 5:
            out.append({'id': command['id'], 't0': t0, 'posted': posted, 'ended': time.time()})
        time.sleep(0.05)
    json.dump(out, sys.stdout)


def stamp(line):
    match = re.match(r'(\S+Z)', line)
    return datetime.datetime.fromisoformat(match.group(1).replace('Z', '+00:00')).timestamp() if match else None


def report(directory):
    runner = [ANSI.sub('', l) for l in open(directory + '/runner.log', errors='replace')]
    commands = json.load(open(directory + '/client.json'))
    assignments = [stamp(l) for l in runner if 'hop: assignments read' in l]
    rows = []
    for c in commands:
        events = {'client posted': c['posted'], 'client ended': c['ended']}
        for line in runner:
            if c['id'] not in line:
                continue
            for key in ('command task started', 'agent incarnation read', 'launch recorded',
                        'started in the agent', 'ended in the agent'):
                if 'hop: ' + key in line:
                    events[key] = stamp(line)
            if 'command reported' in line:
                events['reported ' + re.search(r'state=(\w+)', line).group(1)] = stamp(line)
        later = [t for t in assignments if t >= c['posted']]
        if later:
            events['assignments read'] = later[0]
        rows.append((c['t0'], events))
    print('| hop (time since the previous one) | p50 ms | p90 ms |')
    print('|---|---|---|')
    keys = [key for _, key in HOPS]
    for label, key in HOPS:
        spans = []
        for t0, events in rows:
            if key not in events:
                continue
            before = [events[k] for k in keys[:keys.index(key)] if k in events]
            spans.append((events[key] - (before[-1] if before else t0)) * 1000)
        if spans:
            spans.sort()
            note = '' if len(spans) == len(rows) else f' ({len(spans)} of {len(rows)})'
            print(f'| {label}{note} | {statistics.median(spans):.2f} | {spans[int(len(spans) * 0.9)]:.2f} |')
    total = sorted((e['client ended'] - t0) * 1000 for t0, e in rows)
    print(f'| **round trip** | {statistics.median(total):.2f} | {total[int(len(total) * 0.9)]:.2f} |')


if __name__ == '__main__':
    if sys.argv[1] == 'run':
        run(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        report(sys.argv[2])
