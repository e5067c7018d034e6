//! The connection-manager messages ugdr exchanges over a TCP connection, named after the IB CM
//! MADs they stand for (REQ, REP, RTU, REJ, DREQ, DREP). Each frame is a big-endian `u32`
//! length followed by the body; the body's first byte is the message type.

use std::io::{self, Read, Write};

/// A frame larger than this is a protocol error (the largest message is well under 512 bytes).
const MAX_FRAME: usize = 1024;

/// What the requester tells the responder about its queue pair (REQ) and the responder answers
/// (REP): enough to move each side's QP to RTR and RTS.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Endpoint {
    pub lid: u16,
    pub gid: [u8; 16],
    pub qpn: u32,
    pub psn: u32,
    pub srq: bool,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// Connection request: the port space it was sent to, the requester's endpoint and its
    /// private data.
    Req {
        port_space: u16,
        endpoint: Endpoint,
        private_data: Vec<u8>,
    },
    /// Connection reply (the responder accepted).
    Rep {
        endpoint: Endpoint,
        private_data: Vec<u8>,
    },
    /// Ready to use: the requester's QP is RTS.
    Rtu,
    /// Reject with an IB CM reason code.
    Rej {
        reason: u8,
        private_data: Vec<u8>,
    },
    /// Disconnect request and reply.
    Dreq,
    Drep,
}

const REQ: u8 = 1;
const REP: u8 = 2;
const RTU: u8 = 3;
const REJ: u8 = 4;
const DREQ: u8 = 5;
const DREP: u8 = 6;

fn put_endpoint(out: &mut Vec<u8>, e: &Endpoint) {
    out.extend_from_slice(&e.lid.to_be_bytes());
    out.extend_from_slice(&e.gid);
    out.extend_from_slice(&e.qpn.to_be_bytes());
    out.extend_from_slice(&e.psn.to_be_bytes());
    out.extend_from_slice(&[
        u8::from(e.srq),
        e.responder_resources,
        e.initiator_depth,
        e.flow_control,
        e.retry_count,
        e.rnr_retry_count,
    ]);
}

fn put_private(out: &mut Vec<u8>, data: &[u8]) {
    // Callers bound private data to the IB CM sizes (at most 196 bytes).
    let len = u8::try_from(data.len()).unwrap_or(u8::MAX);
    out.push(len);
    out.extend_from_slice(&data[..usize::from(len)]);
}

/// A cursor over a received body; every read fails cleanly on a short body.
struct Body<'a>(&'a [u8]);

impl Body<'_> {
    fn take(&mut self, n: usize) -> io::Result<&[u8]> {
        if self.0.len() < n {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "short CM message",
            ));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> io::Result<u16> {
        Ok(u16::from_be_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> io::Result<u32> {
        Ok(u32::from_be_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn endpoint(&mut self) -> io::Result<Endpoint> {
        let lid = self.u16()?;
        let gid: [u8; 16] = self.take(16)?.try_into().expect("16 bytes");
        let qpn = self.u32()?;
        let psn = self.u32()?;
        let f = self.take(6)?;
        Ok(Endpoint {
            lid,
            gid,
            qpn,
            psn,
            srq: f[0] != 0,
            responder_resources: f[1],
            initiator_depth: f[2],
            flow_control: f[3],
            retry_count: f[4],
            rnr_retry_count: f[5],
        })
    }
    fn private(&mut self) -> io::Result<Vec<u8>> {
        let n = usize::from(self.u8()?);
        Ok(self.take(n)?.to_vec())
    }
}

impl Message {
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::with_capacity(64);
        match self {
            Message::Req {
                port_space,
                endpoint,
                private_data,
            } => {
                body.push(REQ);
                body.extend_from_slice(&port_space.to_be_bytes());
                put_endpoint(&mut body, endpoint);
                put_private(&mut body, private_data);
            }
            Message::Rep {
                endpoint,
                private_data,
            } => {
                body.push(REP);
                put_endpoint(&mut body, endpoint);
                put_private(&mut body, private_data);
            }
            Message::Rtu => body.push(RTU),
            Message::Rej {
                reason,
                private_data,
            } => {
                body.push(REJ);
                body.push(*reason);
                put_private(&mut body, private_data);
            }
            Message::Dreq => body.push(DREQ),
            Message::Drep => body.push(DREP),
        }
        let mut frame = Vec::with_capacity(4 + body.len());
        frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
        frame.extend_from_slice(&body);
        frame
    }

    pub fn decode(body: &[u8]) -> io::Result<Message> {
        let mut b = Body(body);
        let msg = match b.u8()? {
            REQ => Message::Req {
                port_space: b.u16()?,
                endpoint: b.endpoint()?,
                private_data: b.private()?,
            },
            REP => Message::Rep {
                endpoint: b.endpoint()?,
                private_data: b.private()?,
            },
            RTU => Message::Rtu,
            REJ => Message::Rej {
                reason: b.u8()?,
                private_data: b.private()?,
            },
            DREQ => Message::Dreq,
            DREP => Message::Drep,
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("unknown CM message type {other}"),
                ));
            }
        };
        Ok(msg)
    }

    /// Writes one frame.
    pub fn write_to(&self, mut w: impl Write) -> io::Result<()> {
        w.write_all(&self.encode())
    }

    /// Reads one frame (blocking).
    pub fn read_from(mut r: impl Read) -> io::Result<Message> {
        let mut len = [0u8; 4];
        r.read_exact(&mut len)?;
        let len = u32::from_be_bytes(len) as usize;
        if len == 0 || len > MAX_FRAME {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("CM frame of {len} bytes"),
            ));
        }
        let mut body = vec![0u8; len];
        r.read_exact(&mut body)?;
        Message::decode(&body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint() -> Endpoint {
        Endpoint {
            lid: 0x1234,
            gid: [7; 16],
            qpn: 0xabcdef,
            psn: 0x123456,
            srq: true,
            responder_resources: 4,
            initiator_depth: 2,
            flow_control: 1,
            retry_count: 7,
            rnr_retry_count: 6,
        }
    }

    #[test]
    fn every_message_survives_a_round_trip() {
        let msgs = [
            Message::Req {
                port_space: 0x106,
                endpoint: endpoint(),
                private_data: (0..56).collect(),
            },
            Message::Rep {
                endpoint: endpoint(),
                private_data: vec![9; 196],
            },
            Message::Rtu,
            Message::Rej {
                reason: 28,
                private_data: b"no".to_vec(),
            },
            Message::Dreq,
            Message::Drep,
        ];
        for m in msgs {
            let frame = m.encode();
            assert_eq!(Message::read_from(&frame[..]).unwrap(), m);
        }
    }

    #[test]
    fn truncated_and_unknown_frames_are_errors() {
        let frame = Message::Rep {
            endpoint: endpoint(),
            private_data: vec![1, 2, 3],
        }
        .encode();
        for cut in 0..frame.len() {
            assert!(Message::read_from(&frame[..cut]).is_err(), "cut at {cut}");
        }
        assert!(Message::read_from(&[0, 0, 0, 1, 99][..]).is_err());
        assert!(Message::read_from(&[0, 0, 0, 0][..]).is_err());
        assert!(Message::read_from(&[0xff, 0, 0, 0][..]).is_err());
    }
}
