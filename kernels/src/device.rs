//! Devices. Dispatch on the device happens once, in `tensor::Storage`; model
//! code never names a device. Without the `cuda` feature the CUDA variant still
//! exists so code that mentions it compiles, and every attempt to use it fails
//! with `Error::NoDevice`.

use crate::Result;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    /// A CUDA device by ordinal. Usable only in builds with the `cuda` feature.
    Cuda(usize),
}

impl Device {
    /// Check that this build can use the device.
    pub fn check_available(self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Device::Cuda(i) => crate::cuda::device::CudaDevice::new(i).map(|_| ()),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(i) => cuda_standin::available(i),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = crate::Error;

    /// `cpu`, `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            crate::Error::DeviceName(format!(
                "{s:?} is not a device: expected cpu, cuda or cuda:N (N a device ordinal)"
            ))
        };
        match s.trim() {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(bad),
        }
    }
}

/// The CUDA stand-in: compiled when the `cuda` feature is off.
#[cfg(not(feature = "cuda"))]
mod cuda_standin {
    use crate::{Error, Result};
    pub fn available(ordinal: usize) -> Result<()> {
        Err(Error::NoDevice(format!(
            "cuda:{ordinal} (this build has no CUDA backend)"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::Device;

    #[test]
    fn devices_parse_and_print_alike() {
        for (s, d) in [
            ("cpu", Device::Cpu),
            ("cuda", Device::Cuda(0)),
            ("cuda:3", Device::Cuda(3)),
        ] {
            assert_eq!(s.parse::<Device>().unwrap(), d);
        }
        assert_eq!(
            Device::Cuda(3).to_string().parse::<Device>().unwrap(),
            Device::Cuda(3)
        );
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", ""] {
            let e = bad.parse::<Device>().unwrap_err().to_string();
            assert!(e.contains("expected cpu, cuda or cuda:N"), "{bad}: {e}");
        }
    }
}
