#!/usr/bin/env python3
"""tcp_proxy.py LISTEN_PORT TARGET_HOST:PORT - relays TCP connections on
127.0.0.1:LISTEN_PORT to the target. bench/fleet/run.sh --pg-outage puts one
between the servers and PostgreSQL and kills it for a few seconds: every
connection drops and none can be made, as when the database is restarted or
out of reach."""
import asyncio
import sys


async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def main():
    port = int(sys.argv[1])
    host, target_port = sys.argv[2].rsplit(":", 1)

    async def handle(client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection(host, int(target_port))
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))

    server = await asyncio.start_server(handle, "127.0.0.1", port, reuse_address=True, backlog=1024)
    print(f"proxy on {port}", flush=True)
    async with server:
        await server.serve_forever()


asyncio.run(main())
