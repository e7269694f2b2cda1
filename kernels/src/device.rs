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
